"""Setup of a membership epoch: prepare → build_topology → init_process_group on every worker, with ``auto``'s
choice of backend first, run whenever the manager has no epoch (first update, membership changed, the last update
failed) and always before any replica is paused: the replicas serve while it runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from weightsync.api.config import SyncConfig
from weightsync.api.errors import ConfigError, TopologyError
from weightsync.api.protocols import ActorWorkerGroup, CheckpointEngine, RolloutWorker
from weightsync.api.registry import load_engine_class
from weightsync.api.topology import build_checked_topology, epoch_of, with_epoch
from weightsync.api.types import RankArgs, ReplicaOutcome, WorkerMetadata, WorldMetadata
from weightsync.core.control import auto, steps
from weightsync.core.control.parts import declared_parts, members_metadata, with_declared_parts
from weightsync.core.control.auto import AutoChoice
from weightsync.core.control.rails import LostRails
from weightsync.core.transports.place import PingAnswer, Place
from weightsync.core.transports.plan import Idle, decode_metadata, encode_plan, with_delta_base
from weightsync.core.worker.host import engine_spec

__all__ = ["Epoch", "Members", "Setup"]


class Members(Protocol):
    """What a flow decides at setup: which rollout workers (indices into the round's) join the transport's world;
    the others join the epoch idle."""

    def members(self, world: WorldMetadata) -> list[int]: ...


@dataclass(frozen=True)
class Epoch:
    """One membership epoch, as setup left it."""

    token: str
    world: WorldMetadata
    """Every worker's ``prepare`` metadata."""
    where: dict[str, str]
    """Worker label → its host, for people (errors name unreachable hosts by it)."""
    stripes: tuple[tuple[int, ...], ...]
    """Each group's stripe senders in stripe order (``Topology.stripe_groups``), when the topology dealt updates into
    stripes (empty: not striped)."""
    sources: tuple[int, ...] = ()
    """The senders of a sharded ``actor_wg``, in the order their digests combine (empty: not sharded)."""
    senders: tuple[int, ...] = (0,)
    """The actor ranks that send (``Topology.senders``)."""


class Setup:
    """Builds epochs for one manager: its worker group, backend (or ``auto``) and configuration."""

    def __init__(self, *, actor_wg: ActorWorkerGroup, backend: str, engine_class: type[CheckpointEngine] | None,
                 config: SyncConfig) -> None:
        self.actor_wg = actor_wg
        self.backend = backend
        self.engine_class = engine_class
        self.config = config
        self.choice: AutoChoice | None = None
        """What ``auto`` picked at the last setup (None for a named backend, or before the first)."""
        self.lost_rails = LostRails()

    def pings(self, workers: Sequence[tuple[int, RolloutWorker]]) -> steps.Labelled:
        """A ``ping`` call to every worker, actor ranks first; none if the worker group cannot even start one."""
        try:
            return [*steps.actor_calls("ping", actor_wg=self.actor_wg), *steps.worker_calls(workers, "ping")]
        except Exception:  # noqa: BLE001 - an adapter without ping: no diagnosis, the step's own error stands
            return []

    async def rails_back(self, workers: Sequence[tuple[int, RolloutWorker]]) -> bool:
        """Whether a rail an earlier update lost answers its probes again (then the epoch is rebuilt with stripes
        over it); probed, the replicas serving, only with ``auto`` and a lost rail."""
        if not self.lost_rails.rails or self.engine_class is not None:
            return False
        return await self.lost_rails.recheck(workers, self.pings(workers), self.actor_wg.world_size,
                                             self.config.timeouts.setup)

    async def build(self, stages: dict[str, float], workers: Sequence[tuple[int, RolloutWorker]], flow: Members,
                    *, states: Sequence[ReplicaOutcome], version: int) -> Epoch:
        """prepare → build_topology → init_process_group for a new epoch (``states``: every replica's outcome so
        far; ``version``: the last one the manager sent)."""
        started = time.perf_counter()
        try:
            return await self._build(workers, flow, self.delta_base(states, version))
        finally:
            stages["setup"] = time.perf_counter() - started

    def delta_base(self, states: Sequence[ReplicaOutcome], version: int) -> int | None:
        """With ``SyncConfig.delta``: the version every replica holds, committed and verified, when they all hold
        the manager's last one (``version``; the base the next update's changes are computed against); else None,
        and the update is full for every replica: one stream reaches them all (a ring, a chain, a broadcast), so a
        replica that needs every byte gets them all to everyone, at the cost the deltas would have added on top."""
        if not self.config.delta or not states:
            return None
        held = {state.version if state.state == "committed" else None for state in states}
        return version if held == {version} else None

    async def _build(self, workers: Sequence[tuple[int, RolloutWorker]], flow: Members, delta_base: int | None
                     ) -> Epoch:
        timeout = self.config.timeouts.setup
        actor_size = self.actor_wg.world_size
        backend, config, engine_class = await self._resolve(workers, timeout)
        specs = [engine_spec(backend=backend, config=config, role="actor", rank=rank) for rank in range(actor_size)]
        labelled = steps.actor_calls("prepare", actor_wg=self.actor_wg, engine=specs)
        labelled += steps.worker_calls(workers, "prepare", [
            {"engine": engine_spec(backend=backend, config=config, role="rollout", rank=rank)}
            for rank in range(len(workers))])
        metadata: list[WorkerMetadata] = await steps.gather("prepare", timeout, labelled, fail_fast=True)
        world = WorldMetadata(actor=metadata[:actor_size], rollout=metadata[actor_size:])
        members = flow.members(world)
        labels = [label for label, _ in labelled[actor_size:]]
        topology = with_epoch(build_checked_topology(  # our engines stamp the epoch; any other gets one here
            engine_class, backend=backend, actor_wg_world_size=actor_size, rollout_world_size=len(members),
            metadata=WorldMetadata(actor=world.actor, rollout=members_metadata(world.rollout, members, labels))))
        token = epoch_of(topology.actor[0])
        if topology.sharded and self.choice is not None:  # the report says what runs: a stream per sending rank
            options = {key: value for key, value in self.choice.options.items() if key != "stripes"}
            self.choice = dataclasses.replace(self.choice, options=options, reason=(
                f"{self.choice.reason}; a sharded actor_wg: each of its {len(topology.senders)} sending ranks sends "
                "its own stream"))
        elif len(topology.senders) > topology.stripes and self.choice is not None:  # part groups, a stream each
            groups = len(topology.senders) // topology.stripes
            dealt = f", each dealt into {topology.stripes} stripes" if topology.stripes > 1 else ""
            self.choice = dataclasses.replace(self.choice, groups=(groups, topology.stripes), reason=(
                f"{self.choice.reason}; the hosts differ in what their workers hold: {groups} part groups, each a "
                f"stream of its own from actor ranks {', '.join(map(str, topology.senders))}{dealt}"))
        actor_args = list(topology.actor)
        if delta_base is not None:  # the senders may send only what changed since it
            actor_args = [with_delta_base(args, delta_base) for args in actor_args]
        rollout_args: list[RankArgs] = [encode_plan(Idle(epoch=token)) for _ in workers]
        for member, args in zip(members, topology.rollout):
            rollout_args[member] = args
        if engine_class.verifies_parts:
            with_declared_parts(actor_args, rollout_args, declared_parts(world.rollout, labels), staged=config.staged)
        labelled = steps.actor_calls("init_process_group", actor_wg=self.actor_wg, rank_args=actor_args)
        labelled += steps.worker_calls(workers, "init_process_group", [{"rank_args": args} for args in rollout_args])
        await steps.gather("init_process_group", timeout, labelled, fail_fast=True)
        where = {label: decode_metadata(entry, Place, who=label).host for (label, _), entry in zip(labelled, metadata)}
        return Epoch(token=token, world=world, where=where, stripes=topology.stripe_groups,
                     sources=topology.senders if topology.sharded else (), senders=topology.senders)

    async def _resolve(self, workers: Sequence[tuple[int, RolloutWorker]], timeout: float
                       ) -> tuple[str, SyncConfig, type[CheckpointEngine]]:
        """The backend, configuration and engine class of this setup: the named backend's, or what ``auto`` picks
        from the nodes the workers answer a ping with (actor rank 0 is the sender)."""
        if self.engine_class is not None:
            return self.backend, self.config, self.engine_class
        pings = self.pings(workers)
        if not pings:
            raise ConfigError("backend='auto' needs workers that answer execute_checkpoint_engine('ping'); name a "
                              "backend instead")
        answers = decoded_pings(pings, await steps.gather("setup", timeout, pings))
        actor_size = self.actor_wg.world_size
        await self.lost_rails.probe(workers, answers, actor_size, timeout)
        sender = answers[0]
        self.choice = choice = auto.choose(
            sender_node=sender.node_id, rollout_nodes=[answer.node_id for answer in answers[actor_size:]],
            rdma=all(answer.rdma for answer in answers), rollout_rails=[answer.rail for answer in answers[actor_size:]],
            sender_rails=[answer.rail for answer in answers[:actor_size] if answer.node_id == sender.node_id],
            striping=not self.config.delta, lost_rails=self.lost_rails.rails, shm_free=shm_free(answers),
            bucket_bytes=self.config.bucket_bytes, slots=self.config.slots,
            host_names={answer.node_id: answer.host for answer in answers})
        config = dataclasses.replace(self.config, backend_options={**choice.options, **self.config.backend_options})
        return choice.backend, config, load_engine_class(choice.backend)


def shm_free(answers: Sequence[PingAnswer]) -> dict[str, int]:
    """Each node's room in ``/dev/shm``: the most any of its workers could map (the one holding the host's ring, if
    any, counts it as room: it is reused), for the nodes any of whose workers said."""
    free: dict[str, int] = {}
    for answer in answers:
        if answer.shm_free >= 0:
            free[answer.node_id] = max(answer.shm_free, free.get(answer.node_id, 0))
    return free


def decoded_pings(pings: steps.Labelled, answers: Sequence[Any]) -> list[PingAnswer]:
    """Every worker's ``ping`` answer (``pings``' order), decoded; a ``TopologyError`` naming a worker whose answer
    is not one."""
    decoded = []
    for (label, _), answer in zip(pings, answers):
        if not isinstance(answer, dict):
            raise TopologyError(f"{label} answered ping with a {type(answer).__name__}, not a mapping")
        decoded.append(decode_metadata(answer, PingAnswer, who=label))
    return decoded
