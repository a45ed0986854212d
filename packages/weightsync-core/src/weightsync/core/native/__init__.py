"""The compiled helper (``_stream_copy.c``, loaded with ctypes) and the host copies built on it.

The one module that loads the helper: every other module calls it through the functions here — the copies, and the
delta encoding's three passes (``delta_encode``, ``delta_apply``, ``delta_sum``) — and asks ``compiled()`` whether
it is there. ``HELPER`` is the ctypes library itself, or None; the functions read it at each call, so a test that
sets it to None gets the fallbacks. Where the helper is missing, every copy falls back to libc ``memmove``, the
delta passes are unavailable (a delta update then sends every bucket dense), and ``HELPER_MISSING`` says why
(``weightsync doctor`` shows it).
"""

from __future__ import annotations

import array
import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

from weightsync.core.native.build import cached_library

__all__ = [
    "copy_bytes", "copy_small", "copy_stream", "copy_batch", "copy_columns", "STREAM_COPY", "HELPER", "HELPER_PATH",
    "HELPER_MISSING", "compiled", "delta_encode", "delta_apply", "delta_sum",
]


copy_bytes = ctypes.memmove
"""``copy_bytes(destination, source, nbytes)`` between two host addresses: libc ``memmove`` (ctypes releases the
GIL for the call), bound directly so a small tensor pays no wrapper call. For host buffers it beats
``Tensor.copy_`` (docs/performance.md), with no tensor views to build per call, which is what many small tensors
cost."""


def _held_memmove() -> Callable[[int, int, int], object]:
    try:
        function = ctypes.PyDLL(None).memmove  # PyDLL: the call keeps the GIL
    except (OSError, AttributeError):  # no process-wide symbol table to look it up in
        return ctypes.memmove
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    function.restype = None
    return cast(Callable[[int, int, int], object], function)


copy_small = _held_memmove()
"""``copy_small(destination, source, nbytes)``: ``copy_bytes`` for a piece of at most a few hundred KiB, which
keeps the GIL. Releasing it around a copy of a few KiB costs more than the copy whenever another thread of the
process wants the GIL (the receive thread decoding a header, the sender's planner): every call becomes a forced
switch between the two threads."""


_ABI = 8
"""``WEIGHTSYNC_STREAM_COPY_ABI`` of the ``_stream_copy.c`` this module calls."""


def _load_helper(
    installed: Path = Path(__file__).with_name("_stream_copy.so.1"),
    source: Path = Path(__file__).with_name("_stream_copy.c"),
) -> tuple[ctypes.CDLL | None, Path | None, str]:
    """The compiled helper and where it was loaded from, or None, None and why not.

    The library installed beside this module (built with the package) if it is usable, else one built from
    ``source`` at first use into a per-user cache (``native.build``: an editable checkout whose tree changed after
    its environment was made has no library, or one built from another version of the source)."""
    if os.environ.get("WEIGHTSYNC_STREAM_COPY") == "0":
        return None, None, "WEIGHTSYNC_STREAM_COPY=0"
    library, why = _open_helper(installed)
    if library is not None:
        return library, installed, ""
    built, build_why = cached_library(source) if source.exists() else (None, f"no {source.name} to build it from")
    if built is None:
        return None, None, f"{why}; building it at first use: {build_why}"
    library, built_why = _open_helper(built)
    return (library, built, "") if library is not None else (None, None, f"{why}; {built}: {built_why}")


def _open_helper(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """The helper library at ``path``, if it loads, is of this module's ABI and passes its self-test; else why not."""
    if not path.exists():
        return None, "no compiled _stream_copy helper"
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"the compiled _stream_copy helper does not load ({exc})"
    abi = getattr(library, "weightsync_stream_copy_abi", None)
    if abi is None or abi() != _ABI:
        return None, "a _stream_copy helper built from another version"
    library.weightsync_stream_copy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    library.weightsync_stream_copy.restype = None
    library.weightsync_copy_batch.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64,
                                              ctypes.c_int)
    library.weightsync_copy_batch.restype = None
    library.weightsync_copy_columns.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                ctypes.c_uint64)
    library.weightsync_copy_columns.restype = None
    library.weightsync_delta_encode.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64,
                                                ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                                ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                ctypes.c_void_p)
    library.weightsync_delta_encode.restype = ctypes.c_uint64
    library.weightsync_delta_apply.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                               ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p)
    library.weightsync_delta_apply.restype = ctypes.c_int
    library.weightsync_delta_sum.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    library.weightsync_delta_sum.restype = ctypes.c_uint64
    if not _copies_exactly(library.weightsync_stream_copy) or not _copies_exactly(
        lambda destination, source, nbytes: library.weightsync_copy_batch(
            (ctypes.c_uint64 * 3)(5, 3, nbytes), 1, destination - 5, source - 3, 1)
    ):
        return None, "the compiled _stream_copy helper failed its self-test"
    return library, ""


def _copies_exactly(function: Callable[[int, int, int], object]) -> bool:
    """A copy of odd length between odd offsets (head, streamed body and tail all used) lands byte for byte."""
    nbytes = 3 * 4096 + 77
    source = bytes(range(256)) * (nbytes // 256 + 2)
    source_buffer = ctypes.create_string_buffer(source, len(source))
    destination = ctypes.create_string_buffer(len(source))
    function(ctypes.addressof(destination) + 5, ctypes.addressof(source_buffer) + 3, nbytes)
    expected = bytes(5) + source[3:3 + nbytes]
    return destination.raw == expected + bytes(len(source) - len(expected))


def _stream_copier() -> tuple[Callable[[int, int, int], object], str]:
    if HELPER is None:
        return copy_bytes, f"memmove ({HELPER_MISSING})"
    kind = {2: "avx2", 1: "sse2"}.get(HELPER.weightsync_stream_copy_kind())
    if kind is None:
        return copy_bytes, "memmove (no streaming stores for this CPU)"
    return cast(Callable[[int, int, int], object], HELPER.weightsync_stream_copy), f"{kind} non-temporal stores"


HELPER, HELPER_PATH, HELPER_MISSING = _load_helper()
"""The compiled helper, the library file it was loaded from (``weightsync doctor`` shows it), and why there is none."""
copy_stream, STREAM_COPY = _stream_copier()
"""``copy_stream(destination, source, nbytes)``: ``copy_bytes`` for pieces the copying core will not read back soon
(a bucket it packs, a model tensor it fills), with non-temporal stores: they skip reading each destination line
into the cache first, a third of an ordinary copy's memory traffic. The bytes are therefore not in this core's cache
afterwards: hash the source instead, which is.
Releases the GIL. ``STREAM_COPY`` says which copy runs (``weightsync doctor`` shows it); ``WEIGHTSYNC_STREAM_COPY=0``
in the environment turns the compiled helper off (memmove, and ``copy_batch`` one call per copy)."""


def copy_batch(entries: list[int] | array.array[int], destination_base: int, source_base: int, *,
               stream: bool = False) -> None:
    """Copy every ``(destination offset, source offset, nbytes)`` triple of the flat list ``entries``, from
    ``source_base + source offset`` to ``destination_base + destination offset``; the ranges must not overlap.

    One call for many small tensors (a bucket's worth on a sender, a few hundred KiB's worth on a receiver) instead
    of one ctypes call each, which costs more than a 4 KiB copy itself; ``entries`` kept as an ``array('Q')`` are
    not converted again. ``stream``: write like ``copy_stream`` (for destinations not read back soon, such as a
    receiver's model tensors). Releases the GIL for the batch.
    """
    if HELPER is not None:
        table = entries if isinstance(entries, array.array) else array.array("Q", entries)
        HELPER.weightsync_copy_batch(table.buffer_info()[0], len(table) // 3, destination_base, source_base, stream)
        return
    for index in range(0, len(entries), 3):
        copy_small(destination_base + entries[index], source_base + entries[index + 1], entries[index + 2])


def copy_columns(destinations: array.array[int], sources: array.array[int], sizes: array.array[int], start: int,
                 stop: int, source_base: int) -> None:
    """Copy entries ``start:stop`` of three aligned columns — absolute destination addresses, source offsets from
    ``source_base``, sizes — streaming every destination (``copy_stream``). A receiver's batch for a bucket whose
    entries are known in advance: built without per-tensor appends. Releases the GIL."""
    if HELPER is not None:
        step = destinations.itemsize
        HELPER.weightsync_copy_columns(destinations.buffer_info()[0] + step * start,
                                        sources.buffer_info()[0] + step * start,
                                        sizes.buffer_info()[0] + step * start, stop - start, source_base)
        return
    for index in range(start, stop):
        copy_small(destinations[index], source_base + sources[index], sizes[index])


def compiled() -> bool:
    """Whether the compiled helper is loaded (the delta passes below need it)."""
    return HELPER is not None


def _library() -> ctypes.CDLL:
    if HELPER is None:
        raise RuntimeError(f"delta encoding needs the compiled _stream_copy helper ({HELPER_MISSING or 'turned off'})")
    return HELPER


def delta_encode(rows: array.array[int], out: int, capacity: int, *, open_last: bool,
                 segments: array.array[int] | None = None, parts: int = 0
                 ) -> tuple[int | None, int, int, int, list[int]]:
    """Compare and encode the pieces ``rows`` (flat ``(source address, base address, nbytes, unit, key)`` rows) into
    host memory at ``out``, bringing each base up to its source (the helper's ``weightsync_delta_encode``). Returns
    the encoding's length (None when it would not fit in ``capacity``), the changed bytes, what the bases' keyed sum
    changed by, with ``open_last`` where the last piece's last run ended (its closing byte left out), and with
    ``segments`` (per piece: a count n, then n ``(end, mask)`` pairs covering it) what each of ``parts`` parts' sum
    changed by (part b: the words of segments whose mask has bit b)."""
    changed, sum_change, last = ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0)
    part_changes = (ctypes.c_uint64 * max(parts, 1))()
    length = _library().weightsync_delta_encode(rows.buffer_info()[0], len(rows) // 5, out, capacity,
                                                ctypes.byref(changed), ctypes.byref(sum_change), int(open_last),
                                                ctypes.byref(last),
                                                segments.buffer_info()[0] if segments is not None else None,
                                                part_changes)
    return ((None if length == _NO_ROOM else int(length)), int(changed.value), int(sum_change.value),
            int(last.value), [int(value) for value in part_changes[:parts]])


def delta_apply(encoded: int, nbytes: int, rows: array.array[int], *, summed: bool,
                held: array.array[int] | None = None) -> int | None:
    """Apply the ``nbytes`` of encoding at host address ``encoded`` to the pieces ``rows`` (flat ``(destination
    address, nbytes, unit, key)`` rows), checked whole before a byte is written. None when it is malformed (nothing
    written); else, with ``summed``, the pieces' keyed sum once written, and 0 without. With ``held``, each piece's
    held ranges alone are written and summed (per piece: a count n, then n ``(end, held)`` pairs covering it)."""
    total = ctypes.c_uint64(0)
    if _library().weightsync_delta_apply(encoded, nbytes, rows.buffer_info()[0], len(rows) // 4,
                                         ctypes.byref(total) if summed else None,
                                         held.buffer_info()[0] if held is not None else None) != 0:
        return None
    return int(total.value)


def delta_sum(rows: array.array[int]) -> int:
    """The keyed sum of the host pieces ``rows`` (flat ``(address, nbytes, key)`` rows)."""
    return int(_library().weightsync_delta_sum(rows.buffer_info()[0], len(rows) // 3))


_NO_ROOM = (1 << 64) - 1
"""What ``weightsync_delta_encode`` returns when the encoding does not fit."""
