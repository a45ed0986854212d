"""Carriers: a stream that carries of a tensor only the bytes its receivers hold regions of.

Across hosts, a host whose workers hold regions of a tensor (tensor parallelism split over hosts: each host's workers
hold their rank's rows, or its block of columns) need not take the rest in. A part group's sender (``RankPlan.carry``:
each tensor's regions its group's workers hold, together) sends of such a tensor one **span**: the bytes
``[first, end)``, in the order the tensor travels (row-major, or block after block: :mod:`.blocks`), from the first
byte of those regions to the last (:func:`carried_span`). Its table entries say so (``TensorMeta.span``): their
ranges lie inside it, and the tensor is complete, for its receivers, at the span's end.

- A rows split (dimension 0) is one span exactly; so is a block of a tensor packed block after block. Other regions
  (a block of columns in the tensor's own order) span from their first row to their last: nearly the whole tensor.
- A receiver verifies its part as ever (its part's sums read only its regions, which lie inside the span). A worker
  copying into its own tensors (``copy_into``) writes its regions; one given views (vLLM's loaders) is handed a
  full-shape **carrier**, its span's bytes where they belong and zeros everywhere else, from which its loader takes
  its slice (:class:`weightsync.core.pipeline.unpack.BucketReader`).
- A kept copy of such a tensor holds only the span: it cannot serve a joining replica the whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from weightsync.core.wire.blocks import Blocks, block_index
from weightsync.core.wire.parts import check_box
from weightsync.core.wire.partplans import Box

__all__ = ["carried_span"]


def carried_span(boxes: Sequence[Box] | None, shape: Sequence[int], itemsize: int, blocks: Blocks | None, *,
                 name: str) -> tuple[int, int] | None:
    """The bytes ``[first, end)`` of a tensor of ``shape`` (``itemsize`` bytes per element; packed as ``blocks``, or
    row-major) from the first byte of ``boxes`` to the last; None where that is the whole tensor (or no boxes: held
    whole). A ``ConfigError`` naming the tensor where a box does not fit it."""
    if boxes is None:
        return None
    total = math.prod(shape) * itemsize
    if blocks:
        held = [index for box in boxes if (index := block_index(box, shape, blocks)) is not None]
        if not held or len(held) < len(boxes):
            return None  # not blocks of it: the whole tensor travels
        first, end = min(held) * total // blocks[1], (max(held) + 1) * total // blocks[1]
    else:  # a box's first element and its last, by their row-major indices: no run of it is listed (every update)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        first, end = total, 0
        for start, size in boxes:
            check_box((start, size), shape, name=name)
            if all(size):
                first = min(first, sum(at * stride for at, stride in zip(start, strides)) * itemsize)
                last = sum((at + extent - 1) * stride for at, extent, stride in zip(start, size, strides))
                end = max(end, (last + 1) * itemsize)
        first = min(first, end)  # no element at all: an empty span
    return None if (first, end) == (0, total) else (first, end)
