"""``copy_stream``: the compiled streaming copy (non-temporal stores) behind the engines' large host copies.

Checked from outside: the bytes a copy leaves behind are compared with Python's own slicing, and a pack copy that
goes wrong on the sender is caught by the receiver's digest (the sender hashes the source it copied from, the
receiver the bucket it read).
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import os
import pathlib
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from weightsync.api.errors import DigestMismatchError
from weightsync.core import native
from weightsync.core.native import STREAM_COPY, _copies_exactly, copy_batch, copy_columns, copy_stream
from weightsync.core.native.build import compile_library
from weightsync.core.wire.layout import PIECE_BYTES
import weightsync.core.wire.layout as layout_module

from tests.reliability.test_bad_inputs import Pair, connected_pair

Copier = Callable[[int, int, int], object]
# Sizes around the helper's thresholds (4 KiB: memmove below; 128-byte blocks; 64-byte head alignment).
SIZES = [0, 1, 63, 4095, 4096, 4097, 4096 + 127, 3 * 4096 + 77, 256 * 1024, (1 << 20) + 13]


def lands_exactly(copier: Copier, nbytes: int, destination_offset: int, source_offset: int) -> bool:
    """Copy ``nbytes`` between the given misalignments and compare every byte around and inside the target."""
    source = bytes((index * 7 + 3) % 251 for index in range(nbytes + 64))
    source_buffer = ctypes.create_string_buffer(source, len(source))
    destination = ctypes.create_string_buffer(b"\xee" * (nbytes + 128), nbytes + 128)
    copier(ctypes.addressof(destination) + destination_offset, ctypes.addressof(source_buffer) + source_offset,
           nbytes)
    expected = b"\xee" * destination_offset + source[source_offset:source_offset + nbytes]
    expected += b"\xee" * (nbytes + 128 - len(expected))
    return destination.raw == expected


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize(("destination_offset", "source_offset"), [(0, 0), (5, 3), (64, 1), (33, 64)])
def test_every_byte_lands_and_nothing_else_is_written(nbytes: int, destination_offset: int,
                                                      source_offset: int) -> None:
    assert lands_exactly(copy_stream, nbytes, destination_offset, source_offset)


@pytest.mark.parametrize("broken", ["short", "long", "shifted"])
def test_the_checks_see_a_wrong_copy(broken: str) -> None:
    # Negative controls: one byte too few, one too many, one byte off — the comparison and the helper's own
    # self-test (which decides at import whether the helper is used) both reject each.
    def copier(destination: int, source: int, nbytes: int) -> None:
        if broken == "short":
            ctypes.memmove(destination, source, nbytes - 1)
        elif broken == "long":
            ctypes.memmove(destination, source, nbytes + 1)
        else:
            ctypes.memmove(destination, source + 1, nbytes)

    assert not lands_exactly(copier, 3 * 4096 + 77, 5, 3)
    assert not _copies_exactly(copier)
    assert _copies_exactly(copy_stream)


def test_overlapping_ranges_copy_like_memmove() -> None:
    for shift in (1, 100, 5000):
        data = torch.arange(100_000, dtype=torch.int32).view(torch.uint8)
        expected = data.clone()
        nbytes = data.numel() - shift
        expected[shift:] = data[:nbytes].clone()
        copy_stream(data.data_ptr() + shift, data.data_ptr(), nbytes)
        assert torch.equal(data, expected), shift
        expected = data.clone()
        expected[:nbytes] = data[shift:].clone()
        copy_stream(data.data_ptr(), data.data_ptr() + shift, nbytes)
        assert torch.equal(data, expected), shift


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64" and shutil.which("cc")),
                    reason="the helper is built only on x86-64 Linux with a C compiler")
def test_the_helper_was_built_and_is_used() -> None:
    # The install compiled it (hatch_build.py), or the import did (native.build.cached_library), and the import
    # picked it over memmove.
    assert STREAM_COPY in ("avx2 non-temporal stores", "sse2 non-temporal stores"), STREAM_COPY
    assert copy_stream is not ctypes.memmove


def test_the_environment_can_turn_it_off() -> None:
    code = ("from weightsync.core.native import STREAM_COPY, copy_stream, copy_bytes; "
            "print(STREAM_COPY, copy_stream is copy_bytes)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "WEIGHTSYNC_STREAM_COPY": "0"}, check=True)
    assert result.stdout.split() == ["memmove", "(WEIGHTSYNC_STREAM_COPY=0)", "True"]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A shm sender and receiver in this process, with buckets large enough for pieces the helper copies."""
    yield from connected_pair(bucket_bytes=4 * PIECE_BYTES)


def send_large(pair: Pair, sent: dict[str, torch.Tensor]) -> tuple[BaseException | None, dict[str, torch.Tensor]]:
    destinations = {name: torch.zeros_like(tensor) for name, tensor in sent.items()}

    async def both() -> BaseException | None:
        sending = asyncio.ensure_future(pair.sender.send_weights(list(sent.items())))
        try:
            await pair.receiver.receive_weights().copy_into(destinations)
        except DigestMismatchError as exc:
            return exc
        finally:
            await sending
        return None

    return asyncio.run(both()), destinations


def test_a_wrong_pack_copy_is_caught_by_the_receivers_digest(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = {"big": torch.arange(300_000, dtype=torch.float32), "small": torch.ones(10)}
    error, received = send_large(pair, sent)  # control: the real copy
    assert error is None and all(torch.equal(received[name], sent[name]) for name in sent)

    flipped: list[int] = []

    def flips_a_byte(destination: int, source: int, nbytes: int) -> None:
        copy_stream(destination, source, nbytes)
        if not flipped:  # the sender's first large piece: the bucket then differs from the source it hashed
            flipped.append(destination)
            byte = ctypes.c_uint8.from_address(destination + 7)
            byte.value ^= 0x10

    monkeypatch.setattr(layout_module, "copy_stream", flips_a_byte)
    error, _ = send_large(pair, sent)
    assert isinstance(error, DigestMismatchError), error
    assert flipped


@pytest.mark.parametrize("compiled", [True, False])
def test_a_batch_lands_exactly(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not compiled:  # the pure-Python fallback, one copy per triple
        monkeypatch.setattr(native, "HELPER", None)
    source = torch.arange(50_000, dtype=torch.int32).view(torch.uint8)
    # (destination offset, source offset, nbytes): odd sizes and offsets, one empty, out of order.
    entries = [100, 7, 4096, 0, 9000, 33, 20_000, 123, 5000, 5000, 0, 0]
    for gather in (True, False):  # absolute sources into one buffer (a sender), or the reverse (a receiver, streamed)
        destination = torch.full((30_000,), 0xEE, dtype=torch.uint8)
        expected = destination.clone()
        if gather:
            absolute = list(entries)
            for index in range(0, len(entries), 3):
                absolute[index + 1] += source.data_ptr()
            copy_batch(absolute, destination.data_ptr(), 0)
        else:
            absolute = list(entries)
            for index in range(0, len(entries), 3):
                absolute[index] += destination.data_ptr()
            copy_batch(absolute, 0, source.data_ptr(), stream=True)
        for index in range(0, len(entries), 3):
            to, frm, nbytes = entries[index:index + 3]
            expected[to:to + nbytes] = source[frm:frm + nbytes]
        assert torch.equal(destination, expected)
        # Negative control: the same comparison sees one triple copied one byte short.
        broken = destination.clone()
        broken[100 + 4095] = 0xEE
        assert not torch.equal(broken, expected)


def test_a_helper_built_from_another_version_is_not_used(tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A stale in-place build (its C source changed since) must not be called with today's signatures: a library
    # whose ABI number differs is refused, and the loader builds one from today's source instead.
    if shutil.which("cc") is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64 to build the stale helper")
    source = pathlib.Path(native.__file__).with_name("_stream_copy.c").read_text()
    current = f"WEIGHTSYNC_STREAM_COPY_ABI {native._ABI}"
    assert current in source
    (tmp_path / "stale.c").write_text(source.replace(current, "WEIGHTSYNC_STREAM_COPY_ABI 2"))
    assert compile_library(tmp_path / "stale.c", tmp_path / "stale.so") == ""
    library, why = native._open_helper(tmp_path / "stale.so")
    assert library is None and "built from another version" in why
    monkeypatch.setenv("WEIGHTSYNC_CACHE_DIR", str(tmp_path / "cache"))
    library, path, why = native._load_helper(tmp_path / "stale.so")
    assert library is not None and path is not None and path.parent == tmp_path / "cache" and why == ""
    # The library built from today's source is kept: a later load takes the same file.
    assert native._load_helper(tmp_path / "missing.so.1")[1] == path


@pytest.mark.parametrize("compiled", [True, False])
def test_columns_land_exactly(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not compiled:
        monkeypatch.setattr(native, "HELPER", None)
    source = torch.arange(50_000, dtype=torch.int32).view(torch.uint8)
    destination = torch.full((30_000,), 0xEE, dtype=torch.uint8)
    # (destination offset, source offset, nbytes), the first and last outside start:stop.
    rows = [(0, 0, 10), (100, 7, 4096), (9000, 33, 20_000), (5000, 5000, 0), (29_000, 1, 999), (29_999, 0, 1)]
    addresses = array.array("Q", [destination.data_ptr() + row[0] for row in rows])
    sources = array.array("Q", [row[1] for row in rows])
    sizes = array.array("Q", [row[2] for row in rows])
    expected = destination.clone()
    for to, frm, nbytes in rows[1:5]:
        expected[to:to + nbytes] = source[frm:frm + nbytes]
    copy_columns(addresses, sources, sizes, 1, 5, source.data_ptr())
    assert torch.equal(destination, expected)
    expected[0] = source[0]  # negative control: an entry outside start:stop would have shown
    assert not torch.equal(destination, expected)
