"""The gather buffer of views of tensors split across buckets (``weightsync.core.pipeline.gather``): kept across
tensors and updates, it holds of each tensor what its pieces wrote — a part-holder's regions alone — and zeros
everywhere else, never an earlier tensor's bytes."""

from __future__ import annotations

import pytest
import torch

from weightsync.api.parts import Part
from weightsync.core.pipeline import gather as gather_module
from weightsync.core.pipeline.gather import Gather, _outside
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.partplans import PartPlan
from weightsync.core.wire.parts import PartLayout


@pytest.mark.parametrize(("spans", "cut", "left"), [
    ([(0, 10)], [], [(0, 10)]),
    ([(0, 10)], [(0, 10)], []),
    ([(0, 10)], [(2, 4), (6, 8)], [(0, 2), (4, 6), (8, 10)]),
    ([(0, 4), (6, 10)], [(3, 7)], [(0, 3), (7, 10)]),
    ([(5, 6)], [(0, 2), (8, 9)], [(5, 6)]),
    ([(0, 4), (8, 12)], [(0, 12)], []),
    ([(2, 3), (4, 9)], [(0, 1), (3, 5), (6, 7), (8, 20)], [(2, 3), (5, 6), (7, 8)]),
])
def test_outside_is_each_span_less_the_cut(spans: list[tuple[int, int]], cut: list[tuple[int, int]],
                                           left: list[tuple[int, int]]) -> None:
    assert _outside(spans, cut) == left


def pieces(name: str, tensor: torch.Tensor, size: int) -> list[tuple[TensorMeta, torch.Tensor]]:
    """``tensor``'s bytes in ranges of ``size`` bytes, as a stream carries a tensor split across buckets."""
    data = tensor.contiguous().view(-1).view(torch.uint8)
    return [(TensorMeta(name, "float32", tuple(tensor.shape), low, min(size, data.numel() - low), data.numel(), 0),
             data[low: low + size].clone()) for low in range(0, data.numel(), size)]


def gathered(gather: Gather, name: str, tensor: torch.Tensor, layout: PartLayout | None) -> torch.Tensor:
    out = None
    for meta, piece in pieces(name, tensor, 96):
        out = gather.put(meta, piece, layout)
    assert out is not None
    return out.view(torch.float32).view(tensor.shape)


@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
def test_a_part_holder_gathers_its_regions_on_zeros_and_a_whole_one_everything_in_the_same_buffer(
        stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's rows of ``a``, its columns of ``b`` (each row's run), then ``c`` whole, then ``a`` for a worker of
    the whole model, all in one buffer: each view equals its tensor in what the part holds and is zero elsewhere,
    though ``c`` and the whole ``a`` had filled the buffer before — over two rounds, the buffer never reallocated.
    With every tensor written through the cache, and with streaming stores (as a large one is)."""
    monkeypatch.setattr(gather_module, "STREAM_BYTES", 0 if stream else 1 << 30)
    shapes = {"a": (8, 6), "b": (6, 8), "c": (4, 4)}
    layout = PartLayout(PartPlan.of(Part.split(shapes, dims={"a": 0, "b": 1}, rank=1, parts=2), 1))
    gather = Gather()
    addresses = set()
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        model = {name: torch.rand(shape, generator=generator) + 1 for name, shape in shapes.items()}
        for name, region in (("a", (slice(4, 8),)), ("b", (slice(None), slice(4, 8))), ("c", (slice(None),))):
            view = gathered(gather, name, model[name], layout)
            addresses.add(view.data_ptr())
            assert view[region].equal(model[name][region]), name
            outside = torch.ones(view.shape, dtype=torch.bool)
            outside[region] = False
            assert not view[outside].any(), name
        assert gathered(gather, "a", model["a"], None).equal(model["a"])  # a worker of the whole model
    assert len(addresses) == 1
