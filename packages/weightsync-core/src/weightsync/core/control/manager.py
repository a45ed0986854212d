"""``CheckpointEngineManager``: drives updates from the driver, without ever blocking its event loop.

It keeps the membership (replicas added and removed between updates), builds the membership epoch when it has none
(prepare → build_topology → init_process_group, :mod:`~weightsync.core.control.setup`: on the first update, after
a membership change or a failed update) before any replica is paused, and runs each update through its flow
(:mod:`~weightsync.core.control.flows`: unstaged, or staged with ``SyncConfig.staged``). Every step awaits the
workers' awaitables together under the step's timeout from ``SyncConfig.timeouts``
(``weightsync.core.control.steps.gather``); a timeout names the step and the workers still pending. A flow settles
every replica it paused before it returns or raises: a replica resumes when it holds a complete, verified model —
the new version (committed) or its old one because no byte reached it (untouched). A replica the failed update may
have half-written (torn) stays paused and is repaired by the next update.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from weightsync.api.config import SyncConfig
from weightsync.api.errors import ConcurrentUpdateError, ConfigError, LifecycleError, reject_renamed_keywords
from weightsync.api.protocols import ActorWorkerGroup, CheckpointEngine, RolloutReplica, RolloutWorker
from weightsync.api.registry import load_engine_class
from weightsync.api.types import ReplicaOutcome, UpdateReport
from weightsync.core.control import eviction, health, join, steps
from weightsync.core.control import replicas as replica_steps
from weightsync.core.control import telemetry
from weightsync.core.control.auto import AUTO, AutoChoice, candidates
from weightsync.core.control.flows import Flow, Unstaged
from weightsync.core.control.round import Round
from weightsync.core.control.setup import Epoch, Setup
from weightsync.core.control.staged import Staged
from weightsync.core.worker.host import accepted_options

__all__ = ["CheckpointEngineManager"]

logger = logging.getLogger(__name__)


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
        self.actor_wg = actor_wg
        self.config = config = config or SyncConfig()
        # Fails now, naming the package, if not installed; "auto" picks one at each setup (weightsync.core.control.auto).
        self._setup = Setup(actor_wg=actor_wg, backend=backend, config=config,
                            engine_class=load_engine_class(backend) if backend != AUTO else None)
        _check_options(backend, config)
        self._flow: Flow = Staged(actor_wg=actor_wg, timeouts=config.timeouts) if config.staged else \
            Unstaged(actor_wg=actor_wg, timeouts=config.timeouts, setup=self._setup)
        self._replicas: list[RolloutReplica] = []
        self._states: list[ReplicaOutcome] = []
        self._epoch: Epoch | None = None
        self._version = 0
        self._model = ""
        """What a peer's copy of ``_version`` must match, for catch-up (``join.fingerprint``)."""
        self._stagers: list[RolloutWorker] = []
        """The workers that staged ``_version`` alone on their host (a staged update): peers for catch-up."""
        self._joining: list[RolloutReplica] = []
        """Replicas added since the last update, to catch up from a peer before the next one."""
        self._updating = False
        self.add_replicas(replicas)

    @property
    def engine_class(self) -> type[CheckpointEngine] | None:
        """The named backend's engine class (None with ``auto``, which picks one at each setup)."""
        return self._setup.engine_class

    @engine_class.setter
    def engine_class(self, engine_class: type[CheckpointEngine] | None) -> None:
        self._setup.engine_class = engine_class

    @property
    def choice(self) -> AutoChoice | None:
        """What ``backend="auto"`` picked at the last setup (None for an explicit backend or before the first)."""
        return self._setup.choice

    # -- membership ------------------------------------------------------------------------------------------------

    @property
    def replicas(self) -> tuple[RolloutReplica, ...]:
        return tuple(self._replicas)

    def add_replicas(self, replicas: Sequence[RolloutReplica]) -> None:
        """Add replicas; the next update rebuilds the topology. On a manager that has sent a version they first
        catch up from a peer (``weightsync.core.control.join``), or, where they cannot, get that update in full, as
        every replica does (logged now, with why)."""
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
        if self._version and replicas:
            self._joining += replicas
            why = join.why_not(self.config, version=self._version, model=self._model)
            if why:
                logger.warning("%d replica(s) joined: they get the next update in full, as every replica does (%s)",
                               len(replicas), why)

    def remove_replicas(self, replicas: Sequence[RolloutReplica]) -> None:
        """Remove replicas (e.g. dead ones); the next update rebuilds the topology without them."""
        self._check_idle("remove_replicas")
        for replica in replicas:
            index = next((i for i, known in enumerate(self._replicas) if known is replica), None)
            if index is None:
                raise ConfigError("remove_replicas got a replica this manager does not have")
            del self._replicas[index]
            del self._states[index]
            self._joining = [joining for joining in self._joining if joining is not replica]
        self._renumber()
        self._epoch = None

    def replace_replica(self, old: RolloutReplica, new: RolloutReplica) -> None:
        """A restarted replica: ``old`` leaves the membership and ``new`` joins it (last), catching up from a peer
        before the next update as any replica added does (``weightsync.core.control.join``)."""
        if any(new is known for known in self._replicas):
            raise ConfigError("replace_replica got a new replica this manager already has")
        self.remove_replicas([old])
        self.add_replicas([new])

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
        with self._exclusive("update_weights"):
            if version is None:
                version = self._version + 1
            elif isinstance(version, bool) or not isinstance(version, int) or version <= self._version:
                raise ConfigError(f"version must be an int above the last one ({self._version}), got {version!r}")
            return await self._update(version)

    async def connect(self) -> None:
        """Build the membership epoch now if there is none (prepare → build_topology → init_process_group on every
        worker, the replicas serving), so that the next update starts on connections that exist; each update does
        this itself when it must."""
        with self._exclusive("connect"):
            round_ = Round.of(self._version, self._replicas)
            self._flow.check(round_.workers)
            await self._catch_up(round_)
            await self._ensure_epoch(round_)

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """One update (or connect) of this manager at a time, over at least one replica."""
        if self._updating:
            raise ConcurrentUpdateError(f"{what} while another update of this manager is in flight")
        if not self._replicas:
            raise ConfigError(f"{what} with no replicas")
        self._updating = True
        try:
            yield
        finally:
            self._updating = False

    async def _ensure_epoch(self, round_: Round) -> Epoch:
        if self._epoch is not None and await self._setup.rails_back(round_.workers):
            self._epoch = None  # a lost rail answers again: a rebuild deals stripes over it
        if self._epoch is None:  # before any replica is paused: they serve while it runs
            round_.rebuilt = True
            self._epoch = await self._setup.build(round_.stages, round_.workers, self._flow, states=self._states,
                                                  version=self._version)
        return self._epoch

    async def _update(self, version: int) -> UpdateReport:
        round_ = Round.of(version, self._replicas)
        self._flow.check(round_.workers)  # before any work
        failure: BaseException | None = None
        with telemetry.in_flight():
            try:
                round_ = await self._evict_dead(round_)
                await self._catch_up(round_)
                try:
                    await self._run(round_, self._states)
                except Exception as exc:
                    await self._evict_lost(round_, exc)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._states = round_.outcomes(self._states)
                report = self._report(round_)
                telemetry.record(report, failure=failure)
        self._version = version
        self._model = join.fingerprint(self.config, report, striped=bool(round_.stripes))
        self._stagers = [worker for one in (round_, round_.retry) if one is not None
                         for i, (_, worker) in enumerate(one.workers) if i in one.stagers]
        return report

    async def _catch_up(self, round_: Round) -> None:
        """The replicas added since the last update catch up from a peer, before the epoch is built
        (``weightsync.core.control.join``); where they cannot, the update sends them, and everyone, the full model."""
        joining, self._joining = self._joining, []
        newcomers = [r for r, replica in enumerate(self._replicas) if any(replica is new for new in joining)]
        if not newcomers or join.why_not(self.config, version=self._version, model=self._model):
            return
        peer = join.peer_of(self._replicas, self._states, self._version, config=self.config, stagers=self._stagers)
        if peer is None:
            logger.warning("%d replica(s) joined and no committed replica can serve them version %d (a peer is the "
                           "PeerWorker of a one-worker replica, and when staged without delta it staged the version "
                           "alone on its host): they get this update in full, as every replica does",
                           len(newcomers), self._version)
            return
        outcomes, round_.stages["catch_up"] = await join.catch_up(
            [self._replicas[r] for r in newcomers], peer, setup=self._setup, version=self._version, model=self._model,
            previous=[self._states[r] for r in newcomers])
        for r, outcome in zip(newcomers, outcomes):
            self._states[r] = dataclasses.replace(outcome, replica=r)
            round_.joined.append(self._states[r])

    async def _run(self, round_: Round, previous: Sequence[ReplicaOutcome], *, alone: bool = False) -> None:
        """Setup where needed, then the flow over ``round_`` (``previous``: its replicas' outcomes before it).
        ``alone``: over an epoch of ``round_``'s workers only, full, not kept (a second transfer)."""
        try:
            if alone:
                epoch = await self._setup.build(round_.stages, round_.workers, self._flow, states=(),
                                                version=self._version)
            else:
                epoch = await self._ensure_epoch(round_)
            round_.stripes, round_.sources = epoch.stripes, epoch.sources
            await self._flow.run(round_, epoch, previous)
        except BaseException as exc:
            round_.failure = round_.failure or exc
            self._epoch = None  # connections may be mid-message: rebuild them next time
            self._setup.lost_rails.record(exc)  # a stripe's rail, left out of the rebuild until a probe reaches it
            raise

    async def _evict_lost(self, round_: Round, failure: Exception) -> None:
        """After ``round_`` failed with ``failure``: the replicas that died during it are evicted and the survivors
        that lack the version get it in a second transfer (``weightsync.core.control.eviction``); else ``failure``
        is raised as it is."""
        limit, timeout = self.config.max_evicted, self.config.timeouts.setup
        if not limit:
            raise failure
        lost = await eviction.lost_replicas(round_, failure, self._setup.pings(round_.workers),
                                            self.actor_wg.world_size, timeout)
        if not lost:
            raise failure
        if len(lost) + len(round_.evicted) > limit or len(lost) == len(round_.replicas):
            failure.add_note(f"{len(lost)} replica(s) died during the update, {len(round_.evicted)} before it "
                             f"(SyncConfig.max_evicted is {limit}): none was evicted")
            raise failure
        for r in sorted(lost, reverse=True):
            del self._replicas[r]
        self._epoch = None
        retry = eviction.retry_of(round_, lost, self._states)
        if retry is None:
            return
        again, previous = retry
        try:  # the next update builds an epoch over every replica (this one's is the retried ones' only)
            await self._run(again, previous, alone=True)
        except BaseException as exc:
            exc.add_note(f"in the second transfer, after replica(s) {sorted(lost)} died: its replicas 0.. are the "
                         f"update's {round_.retried}")
            raise

    async def _evict_dead(self, round_: Round) -> Round:
        """Before anything else: the replicas with a dead worker (``weightsync.core.control.health``) leave the
        membership, and the update goes on over the others (their round); more than ``SyncConfig.max_evicted`` of
        them, or every replica, fail the update instead, evicting none, nothing paused."""
        limit = self.config.max_evicted
        if not limit:
            return round_
        started = time.perf_counter()
        dead = await health.dead_replicas(round_.workers, self.config.timeouts.setup)
        round_.stages["health"] = time.perf_counter() - started
        if not dead:
            return round_
        if len(dead) > limit or len(dead) == len(self._replicas):
            failure = steps.root_cause(list(dead.values()))
            failure.add_note(f"{len(dead)} of {len(self._replicas)} replicas are dead (SyncConfig.max_evicted is "
                             f"{limit}): none was evicted or paused")
            raise failure
        for replica in sorted(dead, reverse=True):
            del self._replicas[replica]
            del self._states[replica]
        self._renumber()
        self._epoch = None
        survivors = Round.of(round_.version, self._replicas)
        survivors.evicted, survivors.stages, survivors.started = (health.evicted_outcomes(dead), round_.stages,
                                                                  round_.started)
        return survivors

    def _report(self, round_: Round) -> UpdateReport:
        """The round's report: the backend that ran (``auto``'s pick), and why it was picked."""
        choice = self.choice
        return round_.report(self._states, backend=choice.backend if choice else self.backend,
                             delta=self.config.delta, chosen=f"{choice.name}: {choice.reason}" if choice else "")

    async def verify_loads(self) -> None:
        """Compare what every replica's inference engine holds now (``LoadProvingReplica.weight_checksums``), as
        each update does after its transfer; raise ``LoadVerificationError`` naming the first replica that
        disagrees with the majority. Replicas without checksums are left out."""
        round_ = Round.of(self._version, self._replicas)
        held = await replica_steps.checksums(round_, range(len(self._replicas)), self.config.timeouts.resume,
                                             at_least=2)
        error = replica_steps.disowning(round_, held)
        if error is not None:
            raise error


def _check_options(backend: str, config: SyncConfig) -> None:
    """``ConfigError`` now, before any work, for ``backend_options`` the backend does not take (with ``auto``: any
    backend it may pick here; ``weightsync.core.worker.host.accepted_options``)."""
    options = set(config.backend_options)
    if not options:
        return
    for name in candidates() if backend == AUTO else [backend]:
        accepted = accepted_options(load_engine_class(name))
        unknown = sorted(options - accepted) if accepted is not None else []
        if unknown:
            picked = " (one backend='auto' may pick here)" if backend == AUTO else ""
            raise ConfigError(f"backend_options {unknown} are not options of backend {name!r}{picked}; its options: "
                              f"{', '.join(sorted(accepted or ())) or 'none'}")
