"""``CheckpointEngineManager``: drives one update from the driver, without ever blocking its event loop.

pause replicas → (prepare → build_topology → init_process_group, only when membership changed or the last update
failed) → send/receive → finalize (unless every worker's host did it within its transfer call, as ours do) →
resume. Every step awaits the workers' awaitables together under the step's timeout from ``SyncConfig.timeouts``
(``weightsync.core.control.steps.gather``); a timeout names the step and the workers still pending. Resuming runs in
``finally``: a replica resumes when it holds a complete, verified model — the new version (committed) or its old
one because no byte reached it (untouched). A replica the failed update may have half-written (torn) stays paused
and is repaired by the next update.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from weightsync.api.config import SyncConfig
from weightsync.api.errors import (
    ConcurrentUpdateError,
    ConfigError,
    LifecycleError,
    LoadVerificationError,
    StepTimeoutError,
    reject_renamed_keywords,
)
from weightsync.api.protocols import (
    ActorWorkerGroup,
    CheckpointEngine,
    LoadProvingReplica,
    RolloutReplica,
    RolloutWorker,
    TornAwareReplica,
)
from weightsync.api.registry import load_engine_class
from weightsync.api.topology import build_checked_topology, with_epoch
from weightsync.api.types import (
    RankArgs,
    ReplicaOutcome,
    TransferReport,
    UpdateReport,
    WorkerMetadata,
    WorldMetadata,
)
from weightsync.core.control import auto, steps
from weightsync.core.control.auto import AUTO, AutoChoice
from weightsync.core.control.host import engine_spec
from weightsync.core.control.round import (
    Round,
    disowning,
    host_of,
    pause,
    resume,
    stage,
    stripes_of,
    worker_label,
)
from weightsync.core.control.rails import LostRails, rail_grace
from weightsync.core.control.staged import StagedPlan, check_staging, run_staged

__all__ = ["CheckpointEngineManager"]


class CheckpointEngineManager:
    """Moves ``actor_wg``'s weights into every replica of ``replicas`` with backend ``backend``.

    ``update_weights`` is a coroutine; ``update_weights_sync`` runs it for callers without an event loop.
    Replicas may be added or removed between updates; the next update rebuilds the topology for the new set.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CheckpointEngineManager:
        # Runtime guard for untyped callers, before Python checks __init__'s keywords: `trainer=` gets a message
        # naming `actor_wg=` and the codemod. mypy checks calls against __init__ (no **kwargs), rejecting it.
        reject_renamed_keywords("CheckpointEngineManager", kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        *,
        backend: str = AUTO,
        actor_wg: ActorWorkerGroup,
        replicas: Sequence[RolloutReplica],
        config: SyncConfig | None = None,
    ) -> None:
        if config is not None and not isinstance(config, SyncConfig):
            raise ConfigError(f"config must be a SyncConfig, got {type(config).__name__}")
        world_size = actor_wg.world_size
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"actor_wg.world_size must be a positive int, got {world_size!r}")
        self.backend = backend
        # Fails now, naming the package, if not installed; "auto" picks one at each setup (weightsync.core.control.auto).
        self.engine_class = load_engine_class(backend) if backend != AUTO else None
        self.choice: AutoChoice | None = None
        """What ``backend="auto"`` picked at the last setup (None for an explicit backend or before the first)."""
        self.actor_wg = actor_wg
        self.config = config or SyncConfig()
        self._replicas: list[RolloutReplica] = []
        self._states: list[ReplicaOutcome] = []
        self._epoch: str | None = None
        self._where: dict[str, str] = {}  # worker label -> its host, as the workers said at the last setup
        self._version = 0
        self._updating = False
        self._plan: StagedPlan | None = None
        self._lost_rails = LostRails()
        self._stripes: dict[int, int] = {}
        """The topology's stripes: actor rank → the stripe it sends (none: one sender sends everything)."""
        """Staged updates: each host's stager, from the last setup."""
        self.add_replicas(replicas)

    # -- membership ------------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> tuple[RolloutReplica, ...]:
        return tuple(self._replicas)

    def add_replicas(self, replicas: Sequence[RolloutReplica]) -> None:
        """Add replicas; the next update rebuilds the topology and sends them the full weights."""
        self._check_idle("add_replicas")
        for replica in replicas:
            if any(replica is known for known in self._replicas):
                raise ConfigError("a replica was added twice")
            if not replica.workers:
                raise ConfigError("a replica without workers cannot receive weights")
            self._replicas.append(replica)
            self._states.append(ReplicaOutcome(replica=0, state="untouched", version=None, resumed=False))
        self._renumber()
        self._epoch = None

    def remove_replicas(self, replicas: Sequence[RolloutReplica]) -> None:
        """Remove replicas (e.g. dead ones); the next update rebuilds the topology without them."""
        self._check_idle("remove_replicas")
        for replica in replicas:
            index = next((i for i, known in enumerate(self._replicas) if known is replica), None)
            if index is None:
                raise ConfigError("remove_replicas got a replica this manager does not have")
            del self._replicas[index]
            del self._states[index]
        self._renumber()
        self._epoch = None

    def _renumber(self) -> None:
        self._states = [dataclasses.replace(state, replica=i) for i, state in enumerate(self._states)]

    def status(self) -> list[ReplicaOutcome]:
        """Per replica: the version it holds, whether it is committed, torn or untouched, and whether the last update
        resumed it (``resumed=False`` for a replica no update has included yet)."""
        return list(self._states)

    def _check_idle(self, what: str) -> None:
        if self._updating:
            raise ConcurrentUpdateError(f"{what} while an update is in flight")

    # -- the update ------------------------------------------------------------------------------------------------

    def update_weights_sync(self, *, version: int | None = None) -> UpdateReport:
        """Synchronous convenience for callers without a running event loop (never use it inside one)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.update_weights(version=version))
        raise LifecycleError("update_weights_sync called from a running event loop; use `await update_weights()`")

    async def update_weights(self, *, version: int | None = None) -> UpdateReport:
        if self._updating:
            raise ConcurrentUpdateError("update_weights while another update of this manager is in flight")
        if version is None:
            version = self._version + 1
        elif isinstance(version, bool) or not isinstance(version, int) or version <= self._version:
            raise ConfigError(f"version must be an int above the last one ({self._version}), got {version!r}")
        if not self._replicas:
            raise ConfigError("update_weights with no replicas")
        self._updating = True
        try:
            return await self._update(version)
        finally:
            self._updating = False

    async def _update(self, version: int) -> UpdateReport:
        round_ = Round.of(version, self._replicas)
        if self._lost_rails.rails and self._epoch is not None and self.engine_class is None:
            # A lost rail is probed before each update, the replicas serving; once it answers, a rebuild deals
            # stripes over it again.
            if await self._lost_rails.recheck(round_.workers, self._pings(round_.workers), self.actor_wg.world_size,
                                              self.config.timeouts.setup):
                self._epoch = None
        if self.config.staged:
            return await self._update_staged(round_)
        outcomes: list[ReplicaOutcome] = []
        try:
            await stage(round_.stages, "pause", self.config.timeouts.pause, [
                (f"replica{r}", pause(replica)) for r, replica in enumerate(round_.replicas)
            ])
            if self._epoch is None:
                round_.rebuilt = True
                await self._setup(round_.stages, round_.workers)
            await self._transfer(round_)
        except BaseException as exc:
            round_.failure = exc
            self._epoch = None  # connections may be mid-message: rebuild them next time
            self._lost_rails.record(exc)  # a stripe's rail, left out of the rebuild until a probe reaches it
            raise
        finally:
            outcomes = round_.outcomes(self._states)
            await self._resume(round_, outcomes)
        self._version = version
        return self._report(round_, outcomes)

    async def _update_staged(self, round_: Round) -> UpdateReport:
        """A staged update (:mod:`weightsync.core.control.staged`): no replica is paused before its swap."""
        check_staging(round_.workers)
        try:
            if self._epoch is None or self._plan is None:
                round_.rebuilt = True
                await self._setup(round_.stages, round_.workers)
            plan = self._plan
            if plan is None:
                raise LifecycleError("staged update without a stager plan (setup did not make one)")
            round_.stripes = self._stripes
            errors = await run_staged(round_, actor_wg=self.actor_wg, plan=plan, timeouts=self.config.timeouts)
            if errors:
                raise steps.root_cause(errors)
        except BaseException as exc:
            round_.failure = exc
            self._epoch = None
            self._lost_rails.record(exc)
            raise
        finally:
            outcomes = round_.outcomes(self._states)
            await self._tell_torn(round_.replicas, outcomes)
            for i, outcome in enumerate(outcomes):
                resumed = round_.resumed.get(i, self._states[i].resumed)
                self._states[i] = outcomes[i] = dataclasses.replace(outcome, resumed=resumed)
        self._version = round_.version
        return self._report(round_, outcomes)

    def _report(self, round_: Round, outcomes: list[ReplicaOutcome]) -> UpdateReport:
        return round_.report(outcomes, backend=self.backend, delta=self.config.delta,
                             chosen=f"{self.choice.name}: {self.choice.reason}" if self.choice else "")

    async def _transfer(self, round_: Round) -> None:
        """send/receive on every worker, the digests compared, the proof of load, and finalize where needed."""
        timeouts, workers, version = self.config.timeouts, round_.workers, round_.version
        round_.transfer_started = True
        round_.stripes = self._stripes
        step_start = time.perf_counter()
        sends = list(self.actor_wg.update_weights(version=version))
        receives = [worker.update_weights(version=version) for _, worker in workers]
        labels = [f"actor rank {rank}" for rank in range(len(sends))] + [worker_label(r, w) for r, w in workers]
        outcomes = await steps.gather("transfer", timeouts.transfer + rail_grace(self._stripes),
                                      list(zip(labels, [*sends, *receives])), raise_first=False)
        round_.stages["transfer"] = time.perf_counter() - step_start
        round_.reports = outcomes[len(sends):]
        round_.senders = [outcome for outcome in outcomes[: len(sends)] if isinstance(outcome, TransferReport)]
        failed = {id(outcome): (outcome, label) for outcome, label in zip(outcomes, labels)
                  if isinstance(outcome, BaseException)}  # one timeout error stands for every pending worker
        timed_out = steps.timeout_of(labels, outcomes)
        errors = [outcome if outcome is timed_out else steps.typed_error(outcome, step="transfer", worker=label)
                  for outcome, label in failed.values()]
        if errors:
            raise await self._explain(errors, timed_out, workers)
        round_.check_digests()
        await self._check_loads(round_.stages, round_.replicas, round_.disowned)
        if not all(isinstance(report, TransferReport) and report.finalized for report in outcomes):
            # A host that does not finalize within its transfer call (ours do: one round trip fewer).
            await stage(round_.stages, "finalize", timeouts.finalize, self._all_workers("finalize", workers))

    async def _explain(self, errors: list[BaseException], timed_out: StepTimeoutError | None,
                       workers: list[tuple[int, RolloutWorker]]) -> BaseException:
        """The error a failed transfer raises. When it timed out, every worker is pinged: a host none of whose
        workers answers cannot be reached (``HostUnreachableError`` naming it), and that explains the rest."""
        if timed_out is not None:
            pings = self._pings(workers)
            down = await steps.unreachable(timed_out, self.config.timeouts.transfer, pings, self._where)
            if down is not None:
                for error in errors:
                    if error is not timed_out:
                        down.add_note(f"also: {type(error).__name__}: {error}")
                return down
        return steps.root_cause(errors)

    async def _resolve(self, workers: list[tuple[int, RolloutWorker]], timeout: float
                       ) -> tuple[str, SyncConfig, type[CheckpointEngine]]:
        """The backend, configuration and engine class of this setup: the named backend's, or what ``auto`` picks
        from the nodes the workers answer a ping with (actor rank 0 is the sender)."""
        if self.engine_class is not None:
            return self.backend, self.config, self.engine_class
        pings = self._pings(workers)
        if not pings:
            raise ConfigError("backend='auto' needs workers that answer execute_checkpoint_engine('ping'); name a "
                              "backend instead")
        answers = await steps.gather("setup", timeout, pings)
        nodes = [str(answer.get("node_id")) if isinstance(answer, dict) else "" for answer in answers]
        actor_size = self.actor_wg.world_size
        await self._lost_rails.probe(workers, answers, actor_size, timeout)
        rdma = all(isinstance(answer, dict) and answer.get("rdma") is True for answer in answers)
        rails = [answer.get("rail", 0) if isinstance(answer, dict) else 0 for answer in answers]
        self.choice = choice = auto.choose(
            sender_node=nodes[0], rollout_nodes=nodes[actor_size:], rdma=rdma, rollout_rails=rails[actor_size:],
            sender_rails=[rail for node, rail in zip(nodes[:actor_size], rails) if node == nodes[0]],
            striping=not self.config.delta, lost_rails=self._lost_rails.rails)
        config = dataclasses.replace(self.config, backend_options={**choice.options, **self.config.backend_options})
        return choice.backend, config, load_engine_class(choice.backend)

    def _pings(self, workers: list[tuple[int, RolloutWorker]]) -> list[tuple[str, Awaitable[Any]]]:
        """A ``ping`` call to every worker; none if the worker group cannot even start one."""
        try:
            pings = [(f"actor rank {rank}", call)
                     for rank, call in enumerate(self.actor_wg.execute_checkpoint_engine("ping"))]
            pings += [(worker_label(r, worker), worker.execute_checkpoint_engine("ping")) for r, worker in workers]
        except Exception:  # noqa: BLE001 - an adapter without ping: no diagnosis, the step's own error stands
            return []
        return pings

    async def _setup(self, stages: dict[str, float], workers: list[tuple[int, RolloutWorker]]) -> None:
        """prepare → build_topology → init_process_group for a new membership epoch."""
        started = time.perf_counter()
        timeout = self.config.timeouts.setup
        actor_size = self.actor_wg.world_size
        backend, config, engine_class = await self._resolve(workers, timeout)
        specs = [engine_spec(backend=backend, config=config, role="actor", rank=rank) for rank in range(actor_size)]
        actor_calls = self.actor_wg.execute_checkpoint_engine("prepare", engine=specs)
        labelled: list[tuple[str, Awaitable[Any]]] = [
            (f"actor rank {rank}", call) for rank, call in enumerate(actor_calls)
        ]
        labelled += [
            (worker_label(r, worker), worker.execute_checkpoint_engine(
                "prepare", engine=engine_spec(backend=backend, config=config, role="rollout", rank=rank)))
            for rank, (r, worker) in enumerate(workers)
        ]
        metadata: list[WorkerMetadata] = await steps.gather("prepare", timeout, labelled)
        self._where = {label: host_of(entry) for (label, _), entry in zip(labelled, metadata)}
        rollout = metadata[actor_size:]
        # Staged: only each host's stagers join the transport's world (one, or one per stripe); the host's other
        # workers read their areas.
        world = WorldMetadata(actor=metadata[:actor_size], rollout=rollout)
        self._plan = plan = StagedPlan.of(world) if self.config.staged else None
        members = plan.members if plan is not None else list(range(len(workers)))
        topology = build_checked_topology(
            engine_class, backend=backend, actor_wg_world_size=actor_size, rollout_world_size=len(members),
            metadata=WorldMetadata(actor=metadata[:actor_size], rollout=[rollout[i] for i in members]),
        )
        # Our engines stamp the epoch token in build_topology; an engine that does not gets one here.
        topology = with_epoch(topology)
        epoch = str(topology.actor[0]["epoch"])
        actor_args = list(topology.actor)
        self._stripes = stripes_of(actor_args)
        base = self._delta_base()
        if base is not None:  # the senders may send only what changed since it
            actor_args = [{**args, "delta_base": base} for args in actor_args]
        rollout_args: list[RankArgs] = [{"role": "idle", "epoch": epoch} for _ in workers]
        for member, args in zip(members, topology.rollout):
            rollout_args[member] = args
        init_calls = self.actor_wg.execute_checkpoint_engine("init_process_group", rank_args=actor_args)
        labelled = [(f"actor rank {rank}", call) for rank, call in enumerate(init_calls)]
        labelled += [
            (worker_label(r, worker), worker.execute_checkpoint_engine("init_process_group", rank_args=args))
            for (r, worker), args in zip(workers, rollout_args)
        ]
        await steps.gather("init_process_group", timeout, labelled)
        self._epoch = epoch
        stages["setup"] = time.perf_counter() - started

    def _delta_base(self) -> int | None:
        """With ``SyncConfig.delta``: the version every replica holds, committed and verified, when they all hold
        the same one (the base the next update's changes are computed against); else None, and the update is full
        for every replica: one stream reaches them all (a ring, a chain, a broadcast), so a replica that needs every
        byte gets them all to everyone, at the cost the deltas would have added on top."""
        if not self.config.delta or not self._states:
            return None
        versions = {state.version if state.state == "committed" else None for state in self._states}
        version = versions.pop() if len(versions) == 1 else None
        return version if version is not None and version == self._version else None

    def _all_workers(self, method: str, workers: list[tuple[int, RolloutWorker]]) -> list[tuple[str, Awaitable[Any]]]:
        calls: list[tuple[str, Awaitable[Any]]] = [
            (f"actor rank {rank}", call)
            for rank, call in enumerate(self.actor_wg.execute_checkpoint_engine(method))
        ]
        calls += [(worker_label(r, worker), worker.execute_checkpoint_engine(method)) for r, worker in workers]
        return calls

    async def _resume(self, round_: Round, outcomes: list[ReplicaOutcome]) -> None:
        """Resume every replica that is not torn (tell the torn ones), and record each outcome as resumed or not."""
        resumable = [i for i, outcome in enumerate(outcomes) if outcome.state != "torn"]
        await self._tell_torn(round_.replicas, outcomes)
        try:
            await stage(round_.stages, "resume", self.config.timeouts.resume, [
                (f"replica{i}", resume(round_.replicas[i])) for i in resumable
            ])
            resumed = set(resumable)
        except BaseException:
            resumed = set()
            if round_.failure is None:
                raise
        paused = time.perf_counter() - round_.started  # every replica was paused from the start
        for i, outcome in enumerate(outcomes):
            outcomes[i] = dataclasses.replace(outcome, replica=i, resumed=i in resumed, pause_seconds=paused)
            self._states[i] = outcomes[i]

    async def _tell_torn(self, replicas: list[RolloutReplica], outcomes: list[ReplicaOutcome]) -> None:
        """``torn(reason)`` on every torn replica that has it (it ends the requests it kept); best effort: the
        replica stays paused whatever it answers."""
        calls: list[tuple[str, Awaitable[Any]]] = []
        for i, outcome in enumerate(outcomes):
            replica = replicas[i]
            if outcome.state == "torn" and isinstance(replica, TornAwareReplica):
                calls.append((f"replica{i}", replica.torn(outcome.error or "the update did not complete")))
        if calls:
            await steps.gather("resume", self.config.timeouts.resume, calls, raise_first=False)

    async def verify_loads(self) -> None:
        """Compare what every replica's inference engine holds now (``LoadProvingReplica.weight_checksums``), as
        each update does after its transfer; raise ``LoadVerificationError`` naming the first replica that
        disagrees with the majority. Replicas without checksums are left out."""
        await self._check_loads({}, list(self._replicas), set())

    async def _check_loads(self, stages: dict[str, float], replicas: list[RolloutReplica],
                           disowned: set[int]) -> None:
        """The proof of load: every ``LoadProvingReplica``'s checksums, compared per parameter. A replica holding
        another value than the majority of them is added to ``disowned`` (and torn); with no majority (two replicas
        that disagree) every replica involved is, since none of them can be shown right."""
        provers = [(i, replica) for i, replica in enumerate(replicas) if isinstance(replica, LoadProvingReplica)]
        if len(provers) < 2:
            return
        held: list[Any] = await stage(stages, "verify_load", self.config.timeouts.resume, [
            (f"replica{i}", replica.weight_checksums()) for i, replica in provers
        ])
        error = disowning([(i, dict(sums)) for (i, _), sums in zip(provers, held)], disowned)
        if error is not None:
            raise error


