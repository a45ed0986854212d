"""The two-level tcp chain dealt into stripes (``stripes="rails"``): two actor ranks on the sender's host each send
one stripe, and on each of two receiving hosts the worker on rail s leads stripe s while the other reads it in place.

The workers are engines in threads of this process on pretend hosts (node ids of their own), their rails set in
their metadata as ``local_rail`` would on a host of two rails. Checked from outside the engines: the bytes each
destination holds, each sender's published byte count, and which ``/dev/shm`` rings each receiver maps.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from weightsync.api.registry import load_engine_class
from weightsync.api.testing import case_tensors, raw_bytes
from weightsync.api.types import WorkerContext, WorldMetadata
from weightsync.core.wire.digest import combine_stripes

BUCKET = 1 << 16
ACTOR = [("A", 0), ("A", 1)]  # (host, rail) of each actor rank
ROLLOUT = [("B", 0), ("B", 1), ("C", 0), ("C", 1)]


def _in_threads(calls: list[Callable[[], Any]], timeout: float = 60) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:  # noqa: BLE001 - returned, the test looks
            results[index] = exc

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "an engine call hung"
    return results


@pytest.mark.parametrize("stripes", ["rails", 1])
def test_two_stripes_over_two_rails_arrive_whole_at_every_worker(stripes: Any) -> None:
    engine_class: Any = load_engine_class("tcp")
    options = {"layout": "two_level", "stripes": stripes}
    actors = [engine_class(bucket_bytes=BUCKET, timeout=30, context=WorkerContext(role="actor", rank=rank,
                                                                                  node_id=host), **options)
              for rank, (host, _) in enumerate(ACTOR)]
    rollouts = [engine_class(bucket_bytes=BUCKET, timeout=30, context=WorkerContext(role="rollout", rank=rank,
                                                                                    node_id=host), **options)
                for rank, (host, _) in enumerate(ROLLOUT)]
    engines = [*actors, *rollouts]
    try:
        metadata = [dict(engine.prepare(), rail=rail, hostname=host)
                    for engine, (host, rail) in zip(engines, [*ACTOR, *ROLLOUT])]
        topology = engine_class.build_topology(
            actor_wg_world_size=len(actors), rollout_world_size=len(rollouts),
            metadata=WorldMetadata(actor=metadata[:len(actors)], rollout=metadata[len(actors):]))
        count = 2 if stripes == "rails" else 1
        assert len(topology.senders) == count
        if count == 2:  # an error reading a stripe names it, its rail and the two hosts (the peer in errors)
            peers = [source["peer"] for source in topology.rollout[2]["sources"]]
            assert peers == ["rollout rank 0 (stripe 0, rail 0 from host B to host C)",
                             "rollout rank 3 (stripe 1, in place)"]
        def joining(engine: Any, args: dict[str, Any]) -> Callable[[], Any]:
            return lambda: engine.init_process_group(rank_args={**args, "epoch": "e1"})

        results = _in_threads([joining(engine, dict(args))
                               for engine, args in zip(engines, [*topology.actor, *topology.rollout])])
        assert not [r for r in results if isinstance(r, BaseException)], results
        weights = case_tensors("mixed", 1, BUCKET)

        def receive(engine: Any) -> Any:
            into = {name: torch.zeros_like(tensor) for name, tensor in weights}

            async def run() -> Any:
                stream = engine.receive_weights()
                await stream.copy_into(into)
                return stream.report

            return into, asyncio.run(run())

        for version in (1, 2):  # the connections of one epoch carry update after update
            results = _in_threads([*(lambda e=engine: asyncio.run(e.send_weights(weights, version=version))
                                     for engine in actors),
                                   *(lambda e=engine: receive(e) for engine in rollouts)])
            assert not [r for r in results if isinstance(r, BaseException)], (version, results)
        sent, received = results[:len(actors)], results[len(actors):]
        expected = combine_stripes([report.digest for report in sent[:count]])
        total = sum(raw_bytes(tensor).numel() for _, tensor in weights)
        if count == 2:
            # Each stripe's sender carried part of the model, together all of it.
            assert 0 < sent[0].nbytes < total and 0 < sent[1].nbytes < total
            assert sent[0].nbytes + sent[1].nbytes == total
        else:
            assert sent[0].nbytes == total and sent[1].nbytes == 0  # control: one sender, the other drains
        for into, report in received:
            assert report.digest == expected
            for name, tensor in weights:
                assert torch.equal(raw_bytes(into[name]), raw_bytes(tensor)), name
    finally:
        for engine in engines:
            engine.close()
