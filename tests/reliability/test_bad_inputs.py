"""The bad-input table: each case raises a typed error at the call, before any tensor reaches a receiver's model.

Engines run in this process (one sender, one receiver, real shared memory between them), so each case can also
check, from the receiving side, that nothing was delivered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weightsync.api.config import SyncConfig
from weightsync.api.errors import (
    ConcurrentUpdateError,
    ConfigError,
    DuplicateTensorError,
    LifecycleError,
    TopologyError,
    TransferError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
    WeightStreamError,
)
from weightsync.api.types import WorkerContext, WorldMetadata
from weightsync.core.transports.place import default_node_id
from weightsync.core.worker.engine import BucketCheckpointEngine
from weightsync.shm.engine import ShmCheckpointEngine

BUCKET = 64 * 1024


class Pair:
    """A shm sender and one receiver in this process, connected for one epoch."""

    def __init__(self, *, timeout: float = 10.0, bucket_bytes: int = BUCKET) -> None:
        node = default_node_id()
        self.sender = ShmCheckpointEngine(bucket_bytes=bucket_bytes, timeout=timeout,
                                          context=WorkerContext(role="actor", rank=0, node_id=node))
        self.receiver = ShmCheckpointEngine(bucket_bytes=bucket_bytes, timeout=timeout,
                                            context=WorkerContext(role="rollout", rank=0, node_id=node))
        self.delivered: list[str] = []

    def connect(self, *, receiver_epoch: str | None = None) -> None:
        metadata = WorldMetadata(actor=[self.sender.prepare()], rollout=[self.receiver.prepare()])
        topology = ShmCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=metadata)
        receiver_args = dict(topology.rollout[0])
        if receiver_epoch is not None:
            receiver_args["epoch"] = receiver_epoch
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            sending = pool.submit(self.sender.init_process_group, rank_args=topology.actor[0])
            receiving = pool.submit(self.receiver.init_process_group, rank_args=receiver_args)
            sending.result()
            receiving.result()

    async def _consume(self) -> None:
        async for name, _tensor in self.receiver.receive_weights():
            self.delivered.append(name)

    def update(self, weights: Any) -> tuple[BaseException | None, BaseException | None]:
        async def both() -> list[Any]:
            return list(await asyncio.gather(self.sender.send_weights(weights), self._consume(),
                                             return_exceptions=True))

        sent, received = asyncio.run(both())
        return (sent if isinstance(sent, BaseException) else None,
                received if isinstance(received, BaseException) else None)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def connected_pair(*, bucket_bytes: int = BUCKET) -> Iterator[Pair]:
    """A connected ``Pair``, closed afterwards (the body of a fixture)."""
    made = Pair(bucket_bytes=bucket_bytes)
    made.connect()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    yield from connected_pair()


def good(count: int = 3) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((100,), float(i))) for i in range(count)]


def _rejected(pair: Pair, weights: Any, error: type[BaseException], match: str) -> None:
    sent, received = pair.update(weights)
    assert isinstance(sent, error), repr(sent)
    assert match in str(sent)
    assert isinstance(received, TransferError) and "aborted" in str(received)  # told at once, not at a deadline
    assert pair.delivered == []  # nothing reached the model
    sent, received = pair.update(good())  # and the pair still works
    assert sent is None and received is None and pair.delivered == ["w0", "w1", "w2"]


def test_duplicate_names(pair: Pair) -> None:
    _rejected(pair, [*good(2), ("w1", torch.zeros(3))], DuplicateTensorError, "twice")


def test_empty_update(pair: Pair) -> None:
    _rejected(pair, [], WeightStreamError, "empty")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unsupported_dtype(pair: Pair) -> None:
    quantized = torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.quint8)
    _rejected(pair, [("q", quantized)], UnsupportedDtypeError, "quint8")


def test_tensor_on_a_device_the_backend_does_not_serve(pair: Pair) -> None:
    _rejected(pair, [("m", torch.zeros(4, device="meta"))], UnsupportedDeviceError, "meta")


def test_non_utf8_name(pair: Pair) -> None:
    _rejected(pair, [("bad\udcffname", torch.zeros(4))], WeightStreamError, "UTF-8")


def test_over_long_name(pair: Pair) -> None:
    _rejected(pair, [("x" * 5000, torch.zeros(4))], WeightStreamError, "limit")


def test_non_tensor_item(pair: Pair) -> None:
    _rejected(pair, [("w", [1.0, 2.0])], WeightStreamError, "not a tensor")


def test_weights_stream_raising_half_way(pair: Pair) -> None:
    def gather() -> Iterator[tuple[str, torch.Tensor]]:
        yield "w0", torch.zeros(4)
        raise RuntimeError("all-gather failed")

    _rejected(pair, gather(), WeightStreamError, "all-gather failed")


@pytest.mark.parametrize("bucket_bytes", [0, -4096, 100])
def test_bucket_size_zero_negative_or_below_alignment(bucket_bytes: int) -> None:
    with pytest.raises(ConfigError, match="bucket_bytes"):
        ShmCheckpointEngine(bucket_bytes=bucket_bytes)
    with pytest.raises(ConfigError, match="bucket_bytes"):
        SyncConfig(bucket_bytes=bucket_bytes)


def test_world_size_mismatch() -> None:
    engine = ShmCheckpointEngine(bucket_bytes=BUCKET, context=WorkerContext(role="actor", rank=0, node_id="n"))
    try:
        metadata = WorldMetadata(actor=[engine.prepare()], rollout=[{"node_id": "n"}])
        with pytest.raises(TopologyError, match="rollout_world_size=2 but metadata holds 1"):
            ShmCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=2, metadata=metadata)
    finally:
        engine.close()


def test_metadata_from_another_membership_epoch(caplog: pytest.LogCaptureFixture) -> None:
    stale = Pair(timeout=2.0)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TransferError):
            stale.connect(receiver_epoch="0" * 32)
        assert any("membership epoch" in record.getMessage() for record in caplog.records)
    finally:
        stale.close()


def test_send_before_init() -> None:
    engine = ShmCheckpointEngine(bucket_bytes=BUCKET)
    try:
        with pytest.raises(LifecycleError, match="before init_process_group"):
            asyncio.run(engine.send_weights(good()))
        with pytest.raises(LifecycleError, match="before init_process_group"):
            engine.receive_weights()
    finally:
        engine.close()


def test_use_after_close() -> None:
    engine = ShmCheckpointEngine(bucket_bytes=BUCKET)
    engine.close()
    with pytest.raises(LifecycleError, match="closed"):
        engine.prepare()


def test_two_concurrent_updates_on_one_engine(pair: Pair) -> None:
    async def racing() -> None:
        first = asyncio.ensure_future(pair.sender.send_weights(good()))
        await asyncio.sleep(0)
        with pytest.raises(ConcurrentUpdateError):
            await pair.sender.send_weights(good())
        consumer = asyncio.ensure_future(pair._consume())
        await asyncio.gather(first, consumer)

    asyncio.run(racing())
    assert pair.delivered == ["w0", "w1", "w2"]


def test_version_going_backwards_on_the_manager() -> None:
    from weightsync.core.control.manager import CheckpointEngineManager

    class OneRank:
        world_size = 1

        def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> list[Any]:
            raise AssertionError("nothing may run for a rejected version")

        def update_weights(self, *, version: int) -> list[Any]:
            raise AssertionError("nothing may run for a rejected version")

    class Worker:
        name = "w"

        def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
            raise AssertionError("nothing may run for a rejected version")

        def update_weights(self, *, version: int) -> Any:
            raise AssertionError("nothing may run for a rejected version")

    class Replica:
        workers = [Worker()]

        async def abort_all_requests(self) -> None: ...
        async def release_kv_cache(self) -> None: ...
        async def resume_kv_cache(self) -> None: ...
        async def resume_generation(self) -> None: ...

    manager = CheckpointEngineManager(backend="shm", actor_wg=OneRank(), replicas=[Replica()])
    for version in (0, -3):
        with pytest.raises(ConfigError, match="version must be an int above the last one"):
            asyncio.run(manager.update_weights(version=version))


def test_unknown_engine_option_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown options"):
        ShmCheckpointEngine(bucket_bytes=BUCKET, bucket_size=5)


def test_the_engine_needs_a_transport() -> None:
    with pytest.raises(TypeError, match="engine_class"):
        BucketCheckpointEngine(bucket_bytes=BUCKET)
