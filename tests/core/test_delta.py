"""The delta encoding (``weightsync.core.delta``): what it leaves in the base and what applying it writes, compared
byte for byte with the tensors themselves; a malformed encoding writes nothing."""

from __future__ import annotations

import array
import concurrent.futures

import pytest
import torch

from weightsync.api.errors import WireError
from weightsync.core import native
from weightsync.core.delta import encoding as delta
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.tensors import as_byte_view, dtype_name

pytestmark = pytest.mark.skipif(native.HELPER is None, reason="the compiled helper is not built here")

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
    encoded, changed, _ = encode_summed(metas, new, base, capacity)
    return encoded, changed


def encode_summed(metas: list[TensorMeta], new: dict[str, torch.Tensor], base: torch.Tensor,
                  capacity: int) -> tuple[torch.Tensor | None, int, int]:
    """The encoding (None when it does not fit), the changed bytes and what the base's keyed sum changed by."""
    rows = array.array("Q")
    for meta in metas:
        rows.extend((new[meta.name].data_ptr(), base.data_ptr() + meta.bucket_offset, meta.nbytes,
                     delta.unit_of(meta), delta.piece_key(0, meta.bucket_offset)))
    out = torch.empty(capacity + 64, dtype=torch.uint8)
    length, changed, sum_change, _ = delta.encode(rows, out.data_ptr(), capacity)
    return (None if length is None else out[:length].clone()), changed, sum_change


def rows_into(metas: list[TensorMeta], held: dict[str, torch.Tensor]) -> array.array[int]:
    rows = array.array("Q")
    for meta in metas:
        rows.extend((held[meta.name].data_ptr(), meta.nbytes, delta.unit_of(meta),
                     delta.piece_key(0, meta.bucket_offset)))
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


M64 = (1 << 64) - 1


def reference_sum(index: int, metas: list[TensorMeta], held: dict[str, torch.Tensor]) -> int:
    """The keyed sum as ``_stream_copy.c`` documents it, in plain Python integers: every 8-byte little-endian word
    of each piece (the last zero-filled), x = word XOR key, (x mod 2^32) * (x div 2^32) + x, modulo 2^64."""
    total = 0
    for meta in metas:
        data = as_byte_view(held[meta.name]).numpy().tobytes()
        data += bytes(-len(data) % 8)
        key = delta.piece_key(index, meta.bucket_offset)
        for at in range(0, len(data), 8):
            x = int.from_bytes(data[at:at + 8], "little") ^ key
            total += (x & 0xFFFFFFFF) * (x >> 32) + x
            key = (key + delta.KEY_STEP) & M64
    return total & M64


def held_sum(index: int, metas: list[TensorMeta], held: dict[str, torch.Tensor]) -> int:
    return delta.held_sum(index, [(meta, held[meta.name], 0) for meta in metas])


@pytest.mark.parametrize("python", [False, True], ids=["helper", "numpy"])
def test_keyed_sums_follow_their_definition(monkeypatch: pytest.MonkeyPatch, python: bool) -> None:
    generator = torch.Generator().manual_seed(4)
    # Lengths around the helper's 64-byte vector blocks and ragged tails, and more than a numpy step.
    weights = {f"w{n}": torch.randint(-128, 127, (n,), dtype=torch.int8, generator=generator)
               for n in (0, 1, 7, 8, 9, 63, 64, 65, 200, 4096 + 13)}
    weights["big"] = torch.randn((1 << 19) + 3, generator=generator)
    metas = pieces(weights)
    expected = reference_sum(3, [meta for meta in metas if meta.name != "big"], weights)
    if python:
        monkeypatch.setattr(native, "HELPER", None)
    assert held_sum(3, [meta for meta in metas if meta.name != "big"], weights) == expected
    big = [meta for meta in metas if meta.name == "big"]
    assert held_sum(3, big, weights) == reference_sum(3, big, weights)


def test_a_keyed_sum_of_non_contiguous_tensors_sums_their_values() -> None:
    # Each is summed from a contiguous copy made for it: every copy must outlive the sum (freed early, the next one
    # took its memory and the sum read one tensor's bytes several times: false digest mismatches).
    generator = torch.Generator().manual_seed(8)
    weights = {f"t{n}": torch.randn(64, 48 + n % 2, generator=generator).t() for n in range(6)}
    metas = pieces(weights)
    assert not any(tensor.is_contiguous() for tensor in weights.values())
    assert held_sum(2, metas, weights) == reference_sum(2, metas, weights)


def test_a_keyed_sum_changes_with_any_change_of_what_is_held() -> None:
    generator = torch.Generator().manual_seed(6)
    weights = {"a": torch.randn(1000, generator=generator).to(torch.bfloat16),
               "b": torch.randn(77, generator=generator)}
    metas = pieces(weights)
    before = held_sum(0, metas, weights)
    assert held_sum(0, metas, {name: tensor.clone() for name, tensor in weights.items()}) == before  # control
    flipped = {name: tensor.clone() for name, tensor in weights.items()}
    raw(flipped["a"])[517] ^= 1 << 9  # one bit
    assert held_sum(0, metas, flipped) != before
    swapped = {name: tensor.clone() for name, tensor in weights.items()}
    as_byte_view(swapped["b"])[:16] = torch.cat([as_byte_view(weights["b"])[8:16], as_byte_view(weights["b"])[:8]])
    assert held_sum(0, metas, swapped) != before  # two words trade places
    assert held_sum(1, metas, weights) != before  # the same bytes in another bucket


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int16])
@pytest.mark.parametrize("fraction", [0.0, 0.02, 0.5])
def test_the_sender_updates_its_sum_from_the_changes_and_receivers_sum_while_applying(dtype: torch.dtype,
                                                                                        fraction: float) -> None:
    generator = torch.Generator().manual_seed(2)
    old = {f"w{i}": (torch.randn(shape, generator=generator) * 10).to(dtype)
           for i, shape in enumerate([(64, 33), (7,), (1,), (0,), (3001,)])}
    new = {name: changed_copy(tensor, fraction, seed=i) for i, (name, tensor) in enumerate(old.items())}
    metas = pieces(old)
    base = bucket_of(metas, old)
    old_sum, new_sum = reference_sum(0, metas, old), reference_sum(0, metas, new)
    assert (old_sum == new_sum) == (fraction == 0.0)
    encoded, _, sum_change = encode_summed(metas, new, base, capacity=1 << 20)
    assert (old_sum + sum_change) & M64 == new_sum
    assert encoded is not None
    held = {name: tensor.clone() for name, tensor in old.items()}
    assert delta.apply(encoded, rows_into(metas, held), summed=True) == new_sum
    assert all(torch.equal(raw(held[name]), raw(new[name])) for name in old)


@pytest.mark.parametrize("python", [False, True])
@pytest.mark.parametrize("damage", ["truncated", "extra byte", "run past the end", "gap past the end"])
def test_a_malformed_encoding_writes_nothing(monkeypatch: pytest.MonkeyPatch, python: bool, damage: str) -> None:
    old = {"a": torch.randn(100), "b": torch.randn(50)}
    new, metas, encoded = encoded_change(old, 0.2, seed=5)
    if python:
        monkeypatch.setattr(native, "HELPER", None)
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
    monkeypatch.setattr(native, "HELPER", None)
    by_python = {name: tensor.clone() for name, tensor in old.items()}
    delta.apply(encoded, rows_into(metas, by_python))
    for name in old:
        assert torch.equal(as_byte_view(by_python[name]), as_byte_view(by_helper[name]))
        assert torch.equal(as_byte_view(by_python[name]), as_byte_view(new[name]))


@pytest.mark.parametrize("layout", ["one piece", "pieces"])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.4])
def test_a_bucket_compared_in_two_halves_applies_as_compared_whole(layout: str, fraction: float) -> None:
    generator = torch.Generator().manual_seed(8)
    shapes = [(delta.SPLIT_BYTES,)] if layout == "one piece" else [(300_001,), (5,), (700_000,), (3,)]
    old = {f"w{i}": torch.randn(shape, generator=generator).to(torch.bfloat16) for i, shape in enumerate(shapes)}
    new = {name: changed_copy(tensor, fraction, seed=i) for i, (name, tensor) in enumerate(old.items())}
    # Changes on both sides of the middle word, so a run crosses where the halves meet.
    for tensor in new.values():
        raw(tensor)[tensor.numel() // 2 - 3:tensor.numel() // 2 + 3] += 1
    metas = pieces(old)
    results = []
    with concurrent.futures.ThreadPoolExecutor(1) as beside:
        for pool in (None, beside):
            base = bucket_of(metas, old)
            rows = array.array("Q")
            for meta in metas:
                rows.extend((new[meta.name].data_ptr(), base.data_ptr() + meta.bucket_offset, meta.nbytes,
                             delta.unit_of(meta), delta.piece_key(0, meta.bucket_offset)))
            out = torch.zeros(base.numel(), dtype=torch.uint8)
            length, changed, sum_change, _ = delta.encode(rows, out.data_ptr(), base.numel() - 1, pool)
            assert length is not None and torch.equal(base, bucket_of(metas, new))
            held = {name: tensor.clone() for name, tensor in old.items()}
            applied = delta.apply(out[:length], rows_into(metas, held), summed=True)
            assert all(torch.equal(raw(held[name]), raw(new[name])) for name in old)
            results.append((length, changed, sum_change, applied))
    (whole, split) = results
    assert split[1:] == whole[1:]  # the same changes, sum and applied sum
    assert whole[0] <= split[0] <= whole[0] + 4  # a run across the middle may become two
