"""The two-level tcp chain dealt into stripes (``stripes="rails"``): two actor ranks on the sender's host each send
one stripe, and on each of two receiving hosts the worker on rail s leads stripe s while the other reads it in place.

The workers are engines in threads of this process on pretend hosts (node ids of their own), their rails set in
their metadata as ``local_rail`` would on a host of two rails. Checked from outside the engines: the bytes each
destination holds, each sender's published byte count, and which ``/dev/shm`` rings each receiver maps.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from weightsync.api.errors import ConfigError, DigestMismatchError, WeightsyncError, WireError
from weightsync.api.registry import load_engine_class
from weightsync.api.testing import case_tensors, raw_bytes
from weightsync.api.types import RankArgs, Role, WorkerContext, WorldMetadata
from weightsync.core.control.staged import joined
from weightsync.core.pipeline.staged import staged_weights
from weightsync.core.transports.chain.plan import ChainPlans, ChainReceive
from weightsync.core.transports.plan import decode_metadata, decode_plan
from weightsync.core.transports.settings import EngineMetadata
from weightsync.core.transports.stagearea import PAYLOAD_ALIGN, StageArea
from weightsync.core.wire.codec import TableCache
from weightsync.core.wire.digest import combine_stripes

BUCKET = 1 << 16


def _plans(entries: Sequence[RankArgs]) -> list[Any]:
    """Each rank's plan, decoded as the engine decodes it."""
    return [decode_plan(args, ChainPlans, who="test") for args in entries]

ACTOR = [("A", 0), ("A", 1)]  # (host, rail) of each actor rank
ROLLOUT = [("B", 0), ("B", 1), ("C", 0), ("C", 1)]
WEIGHTS = case_tensors("mixed", 1, BUCKET)


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


def _succeeded(calls: list[Callable[[], Any]], what: object = None) -> list[Any]:
    """``_in_threads``, every call having succeeded."""
    results = _in_threads(calls)
    assert not [r for r in results if isinstance(r, BaseException)], (what, results)
    return results


def _engines(actor: list[tuple[str, int]], rollout: list[tuple[str, int]], **options: Any) -> list[Any]:
    """A tcp engine per actor rank and per rollout rank, on the host each (host, rail) names."""
    engine_class: Any = load_engine_class("tcp")
    roles: list[tuple[Role, list[tuple[str, int]]]] = [("actor", actor), ("rollout", rollout)]
    return [engine_class(bucket_bytes=BUCKET, timeout=30, context=WorkerContext(role=role, rank=rank, node_id=host),
                         **options) for role, hosts in roles for rank, (host, _) in enumerate(hosts)]


def _topology(engines: list[Any], actor: list[tuple[str, int]], rollout: list[tuple[str, int]]
              ) -> tuple[list[dict[str, Any]], Any]:
    """Every engine's metadata (its rail and host set as ``local_rail`` would), and the topology built from it."""
    metadata = [dict(engine.prepare(), rail=rail, hostname=host)
                for engine, (host, rail) in zip(engines, [*actor, *rollout])]
    topology = load_engine_class("tcp").build_topology(
        actor_wg_world_size=len(actor), rollout_world_size=len(rollout),
        metadata=WorldMetadata(actor=metadata[:len(actor)], rollout=metadata[len(actor):]))
    return metadata, topology


def _join(engines: list[Any], topology: Any) -> None:
    def joining(engine: Any, args: dict[str, Any]) -> Callable[[], Any]:
        return lambda: engine.init_process_group(rank_args={**args, "epoch": "e1"})

    _succeeded([joining(engine, dict(args)) for engine, args in zip(engines, [*topology.actor, *topology.rollout])])


def _send(engine: Any, version: int) -> Callable[[], Any]:
    return lambda: asyncio.run(engine.send_weights(WEIGHTS, version=version))


def _load(stream_of: Callable[[], Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """What a stream (``stream_of()``: a receive, or a swap from staging) leaves in fresh destinations, and its
    report."""
    into = {name: torch.zeros_like(tensor) for name, tensor in WEIGHTS}

    async def run() -> Any:
        stream = stream_of()
        await stream.copy_into(into)
        return stream.report

    return into, asyncio.run(run())


def _check_whole(loaded: list[tuple[dict[str, torch.Tensor], Any]], expected: str) -> None:
    for into, report in loaded:
        assert report.digest == expected
        for name, tensor in WEIGHTS:
            assert torch.equal(raw_bytes(into[name]), raw_bytes(tensor)), name


@pytest.mark.parametrize("stripes", ["rails", 1])
def test_two_stripes_over_two_rails_arrive_whole_at_every_worker(stripes: Any) -> None:
    engines = _engines(ACTOR, ROLLOUT, layout="two_level", stripes=stripes)
    actors, rollouts = engines[:len(ACTOR)], engines[len(ACTOR):]
    try:
        _, topology = _topology(engines, ACTOR, ROLLOUT)
        count = 2 if stripes == "rails" else 1
        assert len(topology.senders) == count
        if count == 2:  # an error reading a stripe names it, its rail and the two hosts (the peer in errors)
            peers = [source.peer for source in _plans(topology.rollout)[2].sources]
            assert peers == ["rollout rank 0 (stripe 0, rail 0 from host B to host C)",
                             "rollout rank 3 (stripe 1, in place)"]
        _join(engines, topology)
        for version in (1, 2):  # the connections of one epoch carry update after update
            results = _succeeded([*(_send(engine, version) for engine in actors),
                                  *(functools.partial(_load, engine.receive_weights) for engine in rollouts)],
                                 version)
        sent, received = results[:len(actors)], results[len(actors):]
        total = sum(raw_bytes(tensor).numel() for _, tensor in WEIGHTS)
        if count == 2:
            # Each stripe's sender carried part of the model, together all of it.
            assert 0 < sent[0].nbytes < total and 0 < sent[1].nbytes < total
            assert sent[0].nbytes + sent[1].nbytes == total
        else:
            assert sent[0].nbytes == total and sent[1].nbytes == 0  # control: one sender, the other drains
        _check_whole(received, combine_stripes([report.digest for report in sent[:count]]))
    finally:
        for engine in engines:
            engine.close()


def test_a_staged_update_is_staged_one_stripe_per_stager_and_swapped_whole_from_both_areas() -> None:
    """``staged``: every rollout worker is its host's stager of the stripe of its rail (B and C: one per rail),
    stages that stripe alone into an area of its own, and each worker's swap reads both areas of its host in
    bucket order. Checked from outside: which tensor names each area's bytes hold (each name in exactly one area of
    a host), the bytes each destination holds after the swap, and the digest against the senders' own."""
    engines = _engines(ACTOR, ROLLOUT, layout="two_level", stripes="rails", staged=True)
    actors, rollouts = engines[:len(ACTOR)], engines[len(ACTOR):]
    areas = [StageArea() for _ in rollouts]
    try:
        metadata, topology = _topology(engines, ACTOR, ROLLOUT)
        assert all(decode_metadata(entry, EngineMetadata, who="test").staged for entry in metadata)
        assert topology.senders == (0, 1) and topology.stripes == 2
        rollout = _plans(topology.rollout)
        assert [plan.striping for plan in rollout] == [(0, 2), (1, 2), (0, 2), (1, 2)]
        assert all(isinstance(plan, ChainReceive) for plan in rollout)  # nobody reads another's stripe
        assert rollout[2].source.peer == "rollout rank 0 (stripe 0, rail 0 from host B to host C)"
        _join(engines, topology)
        for version in (1, 2):
            results = _succeeded([*(_send(engine, version) for engine in actors),
                                  *(lambda e=engine, a=area: asyncio.run(e.stage_weights(a, version=version))
                                    for engine, area in zip(rollouts, areas))], version)
        sent, staged = results[:len(actors)], results[len(actors):]
        names = [name for name, _ in WEIGHTS]
        larger = [name for name, tensor in WEIGHTS if raw_bytes(tensor).numel() > BUCKET]  # split over buckets
        assert larger == ["lm_head.weight"]
        for host in (0, 2):  # B's areas, then C's: each tensor's name in one of the host's two, a split one in both
            held = [open(area.path, "rb").read()[: part.nbytes] for area, part in zip(areas[host:host + 2],
                                                                                       staged[host:host + 2])]
            assert [name for name in names if sum(name.encode() in data for data in held) != 1] == larger, host
            assert all(any(name.encode() in data for name in names) for data in held), host
        expected = combine_stripes([report.digest for report in sent])
        hosts = {0: joined(staged[0:2]), 2: joined(staged[2:4])}
        assert [getattr(whole.report, "digest", "") for whole in hosts.values()] == [expected, expected]
        _check_whole(_in_threads([functools.partial(_load, functools.partial(engine.receive_staged,
                                                                             hosts[rank - rank % 2]))
                                  for rank, engine in enumerate(rollouts)]), expected)
        # Negative control: the host's areas handed over in the wrong stripe order are refused, not applied.
        backwards = joined([staged[1], staged[0]])
        refused = _in_threads([functools.partial(_load, functools.partial(rollouts[0].receive_staged, backwards))])
        assert isinstance(refused[0], WeightsyncError), refused
        for stripe in staged[0:2]:  # a stripe's area is not the model: a stager of one cannot serve a catch-up
            with pytest.raises(WireError, match="a stripe"):
                list(staged_weights(stripe, tables=TableCache()))
    finally:
        for engine in engines:
            engine.close()
        for area in areas:
            area.close()


def test_a_whole_staged_update_reads_back_as_the_model_sent_and_a_byte_changed_since_is_refused() -> None:
    """``staged_weights``, what a host's stager serves a joining replica from: every tensor sent, bit for bit, in
    the order sent (``lm_head.weight`` gathered from several buckets); a byte of the area changed after the stage
    is found by the second hash."""
    engines = _engines(ACTOR[:1], ROLLOUT[:1], staged=True)
    area = StageArea()
    try:
        _join(engines, _topology(engines, ACTOR[:1], ROLLOUT[:1])[1])
        _, staged = _succeeded([_send(engines[0], 1), lambda: asyncio.run(engines[1].stage_weights(area, version=1))])
        read = [(name, tensor.dtype, tensor.shape, raw_bytes(tensor).clone())
                for name, tensor in staged_weights(staged, tables=TableCache())]
        assert [(name, dtype, shape) for name, dtype, shape, _ in read] == [
            (name, tensor.dtype, tensor.shape) for name, tensor in WEIGHTS]
        assert all(torch.equal(data, raw_bytes(tensor)) for (*_, data), (_, tensor) in zip(read, WEIGHTS))
        area.tensor[2 * PAYLOAD_ALIGN] ^= 1  # the first payload's first byte (after the area's page and a header)
        with pytest.raises(DigestMismatchError, match="no longer holds what was staged"):
            list(staged_weights(staged, tables=TableCache()))
    finally:
        for engine in engines:
            engine.close()
        area.close()


def test_stripes_over_rails_0_and_2_leave_rail_1_out() -> None:
    """``stripes=[0, 2]`` (what auto asks for once rail 1 was lost): three rails per host, two stripes, sent by the
    actor ranks on rails 0 and 2 and led on each host by its workers on those rails; the worker on rail 1 reads both
    in place. Every worker ends bit-exact, and the peer each reads a stripe from names that stripe's rail."""
    actor_hosts = [("A", 0), ("A", 1), ("A", 2)]
    rollout_hosts = [("B", 0), ("B", 1), ("B", 2), ("C", 0), ("C", 1), ("C", 2)]
    engines = _engines(actor_hosts, rollout_hosts, layout="two_level", stripes=[0, 2])
    actors, rollouts = engines[:3], engines[3:]
    try:
        _, topology = _topology(engines, actor_hosts, rollout_hosts)
        assert topology.senders == (0, 2)  # the actor ranks on rails 0 and 2; rank 1 (rail 1) only drains
        actor, rollout = _plans(topology.actor), _plans(topology.rollout)
        assert [plan.role for plan in actor] == ["sender", "idle", "sender"]
        assert [source.peer for source in rollout[5].sources] == [  # C's worker on rail 2
            "rollout rank 3 (stripe 0, in place)", "rollout rank 2 (stripe 1, rail 2 from host B to host C)"]
        assert [source.local for source in rollout[4].sources] == [True, True]  # C's rail 1 worker
        _join(engines, topology)
        results = _succeeded([*(_send(engine, 1) for engine in actors),
                              *(functools.partial(_load, engine.receive_weights) for engine in rollouts)])
        sent = results[:3]
        assert sent[1].nbytes == 0 and sent[0].nbytes > 0 and sent[2].nbytes > 0
        _check_whole(results[3:], combine_stripes([sent[0].digest, sent[2].digest]))
    finally:
        for engine in engines:
            engine.close()


def test_stripes_with_delta_are_a_config_error() -> None:
    """A delta update travels as one stream, so a named chain backend asked for stripes and delta refuses when the
    engine is made (on every worker, at ``prepare``: before any replica is paused), rather than striping updates
    that then go full; one stripe (the default) takes delta."""
    tcp = load_engine_class("tcp")
    with pytest.raises(ConfigError, match="stripes and delta=True do not combine"):
        tcp(bucket_bytes=BUCKET, layout="two_level", stripes="rails", delta=True)
    tcp(bucket_bytes=BUCKET, layout="two_level", stripes=1, delta=True)


@pytest.mark.parametrize("stripes", [[1, 2], [0, 0], [0, -1], "all", 0, True])
def test_a_malformed_stripes_option_is_a_config_error(stripes: Any) -> None:
    with pytest.raises(ConfigError, match="stripes must be"):
        load_engine_class("tcp")(bucket_bytes=BUCKET, layout="two_level", stripes=stripes)
