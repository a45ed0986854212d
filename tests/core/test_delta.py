"""The delta encoding (``weightsync.core.delta``): what it leaves in the base and what applying it writes, compared
byte for byte with the tensors themselves; a malformed encoding writes nothing."""

from __future__ import annotations

import array

import pytest
import torch

import weightsync.core.tensors as tensors
from weightsync.api.errors import WireError
from weightsync.core import delta
from weightsync.core.codec import TensorMeta
from weightsync.core.tensors import as_byte_view, dtype_name

pytestmark = pytest.mark.skipif(tensors._HELPER is None, reason="the compiled helper is not built here")

DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float64, torch.int16]


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of its size (bitwise comparisons, NaN or not)."""
    return as_byte_view(tensor).view(_RAW[tensor.element_size()])


def changed_copy(tensor: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``tensor`` with about ``fraction`` of its elements given other bits (always other: +1 on the raw bits)."""
    generator = torch.Generator().manual_seed(seed)
    bits = raw(tensor.clone())
    mask = torch.rand(bits.numel(), generator=generator) < fraction
    bits[mask] += 1
    return bits.view(tensor.dtype).reshape(tensor.shape)


def pieces(weights: dict[str, torch.Tensor]) -> list[TensorMeta]:
    metas, at = [], 0
    for name, tensor in weights.items():
        at = (at + 255) & ~255
        metas.append(TensorMeta(name, dtype_name(tensor.dtype), tuple(tensor.shape), 0, tensor.nbytes,
                                tensor.nbytes, at))
        at += tensor.nbytes
    return metas


def encode(metas: list[TensorMeta], new: dict[str, torch.Tensor], base: torch.Tensor,
           capacity: int) -> tuple[torch.Tensor | None, int]:
    rows = array.array("Q")
    for meta in metas:
        rows.extend((new[meta.name].data_ptr(), base.data_ptr() + meta.bucket_offset, meta.nbytes,
                     delta.unit_of(meta)))
    out = torch.empty(capacity + 64, dtype=torch.uint8)
    length, changed = delta.encode(rows, out.data_ptr(), capacity)
    return (None if length is None else out[:length].clone()), changed


def rows_into(metas: list[TensorMeta], held: dict[str, torch.Tensor]) -> array.array[int]:
    rows = array.array("Q")
    for meta in metas:
        rows.extend((held[meta.name].data_ptr(), meta.nbytes, delta.unit_of(meta)))
    return rows


def bucket_of(metas: list[TensorMeta], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    size = metas[-1].bucket_offset + metas[-1].nbytes
    bucket = torch.zeros(size, dtype=torch.uint8)
    for meta in metas:
        bucket[meta.bucket_offset:meta.bucket_offset + meta.nbytes] = as_byte_view(weights[meta.name])
    return bucket


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3])
def test_applying_the_encoding_gives_the_new_bytes_and_the_base_becomes_them(dtype: torch.dtype,
                                                                             fraction: float) -> None:
    generator = torch.Generator().manual_seed(1)
    old = {f"w{i}": (torch.randn(shape, generator=generator) * 10).to(dtype)
           for i, shape in enumerate([(64, 33), (7,), (1,), (0,), (129, 5)])}
    new = {name: changed_copy(tensor, fraction, seed=i) for i, (name, tensor) in enumerate(old.items())}
    metas = pieces(old)
    base = bucket_of(metas, old)
    encoded, changed = encode(metas, new, base, capacity=base.numel())
    expected_changed = sum(int((raw(new[name]) != raw(old[name])).sum()) * old[name].element_size() for name in old)
    assert changed == expected_changed
    assert torch.equal(base, bucket_of(metas, new))  # the base now holds the new version, padding still zero
    assert encoded is not None
    if fraction == 0.0:
        assert encoded.numel() == len(metas)  # one closing byte per tensor
    held = {name: tensor.clone() for name, tensor in old.items()}
    delta.apply(encoded, rows_into(metas, held))
    for name in old:
        assert torch.equal(as_byte_view(held[name]), as_byte_view(new[name])), name


def test_a_dense_change_does_not_fit_and_still_updates_the_base() -> None:
    old = {"w": torch.randn(4096).to(torch.bfloat16)}
    new = {"w": changed_copy(old["w"], 1.0, seed=3)}
    metas = pieces(old)
    base = bucket_of(metas, old)
    encoded, changed = encode(metas, new, base, capacity=base.numel() - 1)
    assert encoded is None
    assert changed == 2 * int((raw(new["w"]) != raw(old["w"])).sum())
    assert torch.equal(base, bucket_of(metas, new))


def encoded_change(old: dict[str, torch.Tensor], fraction: float, *, seed: int
                   ) -> tuple[dict[str, torch.Tensor], list[TensorMeta], torch.Tensor]:
    """``old`` with about ``fraction`` of its elements changed, its pieces, and the encoding of the change."""
    new = {name: changed_copy(tensor, fraction, seed=seed) for name, tensor in old.items()}
    metas = pieces(old)
    encoded, _ = encode(metas, new, bucket_of(metas, old), capacity=1 << 20)
    assert encoded is not None
    return new, metas, encoded


@pytest.mark.parametrize("python", [False, True], ids=["helper", "python"])
def test_piece_by_piece_each_piece_is_written_before_its_callback(monkeypatch: pytest.MonkeyPatch,
                                                                  python: bool) -> None:
    old = {"a": torch.randn(300).to(torch.bfloat16), "b": torch.randn(7, 5), "c": torch.randn(64)}
    new, metas, encoded = encoded_change(old, 0.1, seed=11)
    if python:
        monkeypatch.setattr(tensors, "_HELPER", None)
    held = {name: tensor.clone() for name, tensor in old.items()}
    seen: list[tuple[int, bool]] = []
    delta.apply(encoded, rows_into(metas, held),
                lambda piece: seen.append((piece, torch.equal(raw(held[metas[piece].name]),
                                                              raw(new[metas[piece].name])))))
    assert seen == [(0, True), (1, True), (2, True)]
    # Negative control of the check inside the callback: a piece not yet written compares unequal.
    assert not torch.equal(raw(old["c"]), raw(new["c"]))
    broken = torch.cat([encoded, torch.zeros(1, dtype=torch.uint8)])
    held = {name: tensor.clone() for name, tensor in old.items()}
    calls: list[int] = []
    with pytest.raises(WireError, match="malformed delta"):
        delta.apply(broken, rows_into(metas, held), calls.append)
    assert calls == [] and all(torch.equal(raw(held[name]), raw(old[name])) for name in old)


@pytest.mark.parametrize("python", [False, True])
@pytest.mark.parametrize("damage", ["truncated", "extra byte", "run past the end", "gap past the end"])
def test_a_malformed_encoding_writes_nothing(monkeypatch: pytest.MonkeyPatch, python: bool, damage: str) -> None:
    old = {"a": torch.randn(100), "b": torch.randn(50)}
    new, metas, encoded = encoded_change(old, 0.2, seed=5)
    if python:
        monkeypatch.setattr(tensors, "_HELPER", None)
    # Negative control first: the intact encoding applies (through the same path).
    held = {name: tensor.clone() for name, tensor in old.items()}
    delta.apply(encoded, rows_into(metas, held))
    assert all(torch.equal(held[name], new[name]) for name in old)
    data = bytearray(encoded.numpy().tobytes())
    if damage == "truncated":
        data = data[:-3]
    elif damage == "extra byte":
        data += b"\x00"
    elif damage == "run past the end":
        data = bytearray(b"\x7f\x00" + bytes(4 * 0x7f) + b"\x00\x00")  # 127 units into a 100-element tensor
    else:
        data = bytearray(b"\x01\x7f" + bytes(4) + b"\x00\x00")  # one unit at element 127
    broken = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    held = {name: tensor.clone() for name, tensor in old.items()}
    with pytest.raises(WireError, match="malformed delta"):
        delta.apply(broken, rows_into(metas, held))
    assert all(torch.equal(held[name], old[name]) for name in old)


def test_the_python_apply_writes_what_the_helper_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    old = {"a": torch.randn(1000).to(torch.bfloat16), "b": torch.randn(3, 3)}
    new = {name: changed_copy(tensor, 0.1, seed=9) for name, tensor in old.items()}
    metas = pieces(old)
    encoded, _ = encode(metas, new, bucket_of(metas, old), capacity=1 << 20)
    assert encoded is not None
    by_helper = {name: tensor.clone() for name, tensor in old.items()}
    delta.apply(encoded, rows_into(metas, by_helper))
    monkeypatch.setattr(tensors, "_HELPER", None)
    by_python = {name: tensor.clone() for name, tensor in old.items()}
    delta.apply(encoded, rows_into(metas, by_python))
    for name in old:
        assert torch.equal(as_byte_view(by_python[name]), as_byte_view(by_helper[name]))
        assert torch.equal(as_byte_view(by_python[name]), as_byte_view(new[name]))
