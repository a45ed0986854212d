"""The gather buffers of views of tensors that arrive in pieces (``weightsync.core.pipeline.gather``): kept across
tensors and updates, each holds of its tensor what its pieces wrote — a part-holder's regions alone — and zeros
everywhere else, never an earlier tensor's bytes; one sender's pieces in one buffer, several senders' (a sharded
``actor_wg``) in as many as are in use at once."""

from __future__ import annotations

import pytest
import torch

from weightsync.api.parts import Part
from weightsync.core.pipeline import gather as gather_module
from weightsync.core.pipeline.gather import Gathers, _outside
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


def gathered(gather: Gathers, name: str, tensor: torch.Tensor, layout: PartLayout | None) -> torch.Tensor:
    gather.recycle()  # the consumer asks for its next view
    out = None
    for meta, piece in pieces(name, tensor, 96):
        out = gather.put(meta, piece, layout)
    assert out is not None
    return out.view(torch.float32).view(tensor.shape)


@pytest.mark.parametrize("kept", [16, 1], ids=["exact", "hull"])
@pytest.mark.parametrize("stream", [False, True], ids=["cached", "streamed"])
def test_a_part_holder_gathers_its_regions_on_zeros_and_a_whole_one_everything_in_the_same_buffer(
        stream: bool, kept: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's rows of ``a``, its columns of ``b`` (each row's run), then ``c`` whole, then ``a`` for a worker of
    the whole model, all in one buffer: each view equals its tensor in what the part holds and is zero elsewhere,
    though ``c`` and the whole ``a`` had filled the buffer before — over two rounds, the buffer never reallocated.
    With every tensor written through the cache, and with streaming stores (as a large one is); with the bytes to
    zero found exactly, and as the stale ranges' hull (as for a block of columns)."""
    monkeypatch.setattr(gather_module, "STREAM_BYTES", 0 if stream else 1 << 30)
    monkeypatch.setattr(gather_module, "KEPT_SPANS", kept)
    shapes = {"a": (8, 6), "b": (6, 8), "c": (4, 4)}
    layout = PartLayout(PartPlan.of(Part.split(shapes, dims={"a": 0, "b": 1}, rank=1, parts=2), 1))
    gather = Gathers()
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


def test_several_senders_pieces_in_any_order_gather_each_tensor_in_a_buffer_of_its_own_reused_across_updates() -> None:
    """A sharded ``actor_wg``'s streams: rank 1's rows of ``a`` and ``b`` arrive from two senders interleaved (``b``'s
    tail before ``a``'s head), so both are being gathered at once; ``a``'s view is still held when ``b`` completes.
    Each view equals its tensor in the part and is zero elsewhere, the two views lie in different buffers, and the
    next updates (the same pieces, after an update that failed with ``a`` half gathered) reuse those two buffers
    and never a third: they are faulted in once."""
    shapes = {"a": (8, 6), "b": (8, 6)}
    layout = PartLayout(PartPlan.of(Part.split(shapes, dims={"a": 0, "b": 0}, rank=1, parts=2), 1))
    gather = Gathers()
    addresses: list[set[int]] = []
    for update in range(4):
        generator = torch.Generator().manual_seed(update)
        model = {name: torch.rand(shape, generator=generator) + 1 for name, shape in shapes.items()}
        (a0, a1), (b0, b1) = pieces("a", model["a"], 96), pieces("b", model["b"], 96)
        gather.start()
        if update == 1:  # fails with a's first piece in, b not begun
            assert gather.put(*a1, layout) is None
            continue
        assert gather.put(*a1, layout) is None and gather.put(*b1, layout) is None
        a = gather.put(*a0, layout)
        assert a is not None
        b = gather.put(*b0, layout)  # a's view still held: b is in its own buffer
        assert b is not None
        addresses.append({a.data_ptr(), b.data_ptr()})
        for name, view in (("a", a), ("b", b)):
            view = view.view(torch.float32).view(shapes[name])
            assert view[4:].equal(model[name][4:]), name
            assert not view[:4].any(), name  # rank 0's rows: zeros, not the other tensor's bytes
    assert all(len(seen) == 2 for seen in addresses) and addresses[0] == addresses[1] == addresses[2]


def test_a_buffer_lent_with_a_view_is_not_written_until_the_consumer_asks_for_more() -> None:
    """One sender's split tensors: the second does not overwrite the first's view while it is held (a consumer that
    takes two views without asking in between), and takes its buffer once the consumer has asked for more."""
    gather = Gathers()
    first, second = torch.arange(48.0).view(8, 6), -torch.arange(48.0).view(8, 6)
    held = gathered(gather, "a", first, None)
    out = None
    for meta, piece in pieces("b", second, 96):
        out = gather.put(meta, piece, None)
    assert out is not None and held.equal(first) and out.view(torch.float32).view(8, 6).equal(second)
    assert out.data_ptr() != held.data_ptr()
    assert gathered(gather, "c", first, None).data_ptr() in {held.data_ptr(), out.data_ptr()}
