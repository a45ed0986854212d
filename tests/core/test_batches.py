"""``BatchedWeights.next_batch``: a bucket's tensors at once, as views valid until the next call.

Real shm engines (the ``pair`` fixture: 64 KiB buckets, a ring of receive buffers the sender refills as soon as
one is released), so a view kept past its batch is overwritten by a later bucket: the negative control shows it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from weightsync.api.protocols import BatchedWeights
from weightsync.api.types import TransferReport

from tests.core.test_copy_into import small_model
from tests.reliability.test_bad_inputs import Pair, pair  # noqa: F401  (the fixture)

Batch = list[tuple[str, torch.Tensor]]


def model() -> dict[str, torch.Tensor]:
    """About 20 buckets of 64 KiB (more than the ring's 4 buffers): small tensors, one split across three buckets,
    40 of 16 KB, and split tensors back to back (a bucket that completes one starts the next, which the receiver
    gathers in the same scratch buffer)."""
    sent = small_model()
    sent.update({f"x{i}": torch.full((4096,), float(i)) for i in range(40)})
    sent.update({f"y{i}": torch.arange(i, i + 25_000, dtype=torch.float32) for i in range(3)})
    return sent


def receive(pair: Pair, sent: dict[str, torch.Tensor],  # noqa: F811
            consume: Callable[[BatchedWeights], object]) -> TransferReport | None:
    async def both() -> TransferReport | None:
        sending = asyncio.ensure_future(pair.sender.send_weights(list(sent.items())))
        stream = pair.receiver.receive_weights()
        assert isinstance(stream, BatchedWeights)
        await consume(stream)  # type: ignore[misc]
        await sending
        return stream.report

    return asyncio.run(both())


def test_every_tensor_arrives_once_a_bucket_at_a_time_and_stays_valid_through_its_batch(pair: Pair  # noqa: F811
                                                                                       ) -> None:
    sent = model()
    batches: list[list[str]] = []
    stale: list[str] = []

    async def consume(stream: BatchedWeights) -> None:
        while (batch := await stream.next_batch()) is not None:
            await asyncio.sleep(0.005)  # the sender meanwhile refills every buffer it may
            stale.extend(name for name, view in batch if not torch.equal(view, sent[name]))
            batches.append([name for name, _ in batch])

    report = receive(pair, sent, consume)
    assert stale == []
    names = [name for batch in batches for name in batch]
    assert sorted(names) == sorted(sent) and len(names) == len(sent)
    assert report is not None and report.tensors == len(sent)
    # a batch per bucket that completes a tensor, and one more where a gathered tensor ended a batch (4 split
    # tensors); many tensors per batch
    assert 1 < len(batches) <= report.buckets + 4
    assert max(len(batch) for batch in batches) > 10


def test_views_kept_past_their_batch_are_overwritten(pair: Pair) -> None:  # noqa: F811
    # Negative control for the check above: the same views, compared only at the end of the stream.
    sent = model()
    kept: Batch = []

    async def consume(stream: BatchedWeights) -> None:
        while (batch := await stream.next_batch()) is not None:
            kept.extend(batch)
            await asyncio.sleep(0.005)

    receive(pair, sent, consume)
    assert any(not torch.equal(view, sent[name]) for name, view in kept)


def test_a_batch_holds_what_is_left_of_the_bucket_after_anext(pair: Pair) -> None:  # noqa: F811
    sent = model()
    first: list[str] = []
    batches: list[list[str]] = []

    async def consume(stream: BatchedWeights) -> None:
        name, view = await stream.__anext__()  # type: ignore[attr-defined]
        assert torch.equal(view, sent[name])
        first.append(name)
        while (batch := await stream.next_batch()) is not None:
            batches.append([name for name, _ in batch])
        assert await stream.next_batch() is None  # and stays at the end

    report = receive(pair, sent, consume)
    assert first + [name for batch in batches for name in batch] == list(sent)
    assert report is not None and report.tensors == len(sent)
