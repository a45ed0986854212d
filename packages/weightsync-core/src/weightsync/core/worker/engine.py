"""``BucketCheckpointEngine``: the ``CheckpointEngine`` lifecycle over a backend's :class:`Transport`, written once.

A backend does not subclass the engine: it supplies a ``Transport`` (its buffers, connections and topology) and
gets its engine class from :func:`engine_class`. The engine owns the lifecycle (``prepare`` → ``build_topology``
→ ``init_process_group`` → ``send_weights`` / ``receive_weights`` → ``finalize`` / ``close``), the epoch, and who
holds it (:mod:`weightsync.core.pipeline.handover`); the sender's pipeline is :mod:`weightsync.core.pipeline.send`, the receiver's
:mod:`weightsync.core.pipeline.receive`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from weightsync.api.errors import ConfigError, LifecycleError, TopologyError, reject_renamed_keywords
from weightsync.api.protocols import ReceivedWeights
from weightsync.api.topology import check_sizes, with_epoch
from weightsync.api.types import RankArgs, StagedUpdate, Topology, TransferReport, WorkerMetadata, WorldMetadata
from weightsync.core.pipeline.handover import Handover
from weightsync.core.delta.receiver import ReceiverDelta
from weightsync.core.pipeline.receive import ReceiveContext, ReceiveStream
from weightsync.core.pipeline.send import SendPipeline, StreamPlan, drain
from weightsync.core.pipeline.staged import stage_update
from weightsync.core.pipeline.trace import Tracer
from weightsync.core.pipeline.unpack import BucketReader
from weightsync.core.transports.device import accepted_devices
from weightsync.core.transports.plan import RankPlan, RankRole, decode_plan
from weightsync.core.transports.rules import CheckedReceiver, checked_sender
from weightsync.core.transports.settings import EngineBase
from weightsync.core.transports.stagearea import StageArea, StagedReceiver
from weightsync.core.transports.chain.stripes import StripedReceiver
from weightsync.core.transports.sources import SourcesReceiver
from weightsync.core.transports.seam import ReceiverTransport, SenderTransport
from weightsync.core.transports.transport import Transport
from weightsync.core.wire.digest import StripedDigest, UpdateDigest
from weightsync.core.wire.partplans import PartPlan
from weightsync.core.wire.parts import PartLayout, PartSums
from weightsync.core.wire.sources import SourcesDigest, SourcesSums, StripesSums

__all__ = ["BucketCheckpointEngine", "engine_class", "RankRole", "guard_build_topology"]



class BucketCheckpointEngine(EngineBase):
    """The engine of every bucket backend; implements the ``CheckpointEngine`` Protocol over ``transport_class``.

    Built by :func:`engine_class`; options are those of :class:`~weightsync.core.transports.settings.EngineSettings` plus the
    transport's own.
    """

    name: ClassVar[str] = "bucket"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    transport_class: ClassVar[type[Transport]]

    verifies_parts: ClassVar[bool] = True
    """A rollout worker that declared its part reads and verifies only its part's bytes of a full update
    (:mod:`weightsync.core.wire.parts`); a delta update, small, is verified whole."""
    checks_transport_rules: ClassVar[bool] = True
    """Takes ``check_transport`` (tests): True, or the seconds each release of a host bucket waits before its bytes
    are compared (default 2 ms); its transports are then wrapped in :mod:`weightsync.core.transports.rules`' checks,
    which raise ``TransportRuleError`` when the pipeline or the transport breaks a rule between them."""

    def __init__(self, *, bucket_bytes: int, check_transport: bool | float = False, **options: Any) -> None:
        if not hasattr(type(self), "transport_class"):
            raise TypeError(f"{type(self).__name__} has no transport: build engine classes with "
                            "engine_class(SomeTransport)")
        super().__init__(bucket_bytes=bucket_bytes, **options)
        if not isinstance(check_transport, (bool, int, float)) or check_transport < 0:
            raise ConfigError(f"check_transport must be a bool or seconds >= 0, got {check_transport!r}")
        self._check_transport = check_transport is not False
        self._check_hold = 0.002 if check_transport is True else float(check_transport)
        self.transport = self.transport_class(self.settings)
        if self.settings.delta and self.transport.buffers == "device":
            raise ConfigError(f"{self.name}: delta updates are compared and encoded in host memory, and this engine's "
                              "buckets live on the device: use SyncConfig(delta=False) with it, or a backend with "
                              "host buckets (shm, gloo, tcp, nixl, mooncake without a device ring)")
        self._policy = self.transport.policy()
        self._tracer = Tracer(f"{self.settings.context.role} {self.settings.context.rank}")
        self._handover = Handover(self.name, self.settings.timeout)
        self._epoch: str | None = None
        self._role: RankRole | None = None
        self._sender_rank = 0
        self._stripe = (0, 1)
        """(s, K): this epoch's stripe of a sender or of a stager that holds one stripe, or the stripes a receiver
        reads (s 0); (0, 1) unstriped."""
        self._one_stripe = False
        """A stager of one stripe of a staged striped update (``its plan's ``stripe```` on a receiver)."""
        self._sender: SenderTransport | None = None
        self._receiver: ReceiverTransport | None = None
        self._parts: list[PartLayout] = []
        """A sender's: the distinct parts its receivers declared (``RankPlan.parts``), for the epoch (their layouts'
        runs and steps kept across epochs in ``_layouts``)."""
        self._stream = StreamPlan()
        """A sender's: what its plan says its stream carries."""
        self._part: PartLayout | None = None
        """A rollout worker's that declared its part (``RankPlan.part``), for the epoch (as ``_parts``)."""
        self._sources: tuple[int, ...] = ()
        """A receiver's of a sharded ``actor_wg``: the senders whose streams it reads (``RankPlan.streams``)."""
        self._layouts = PartLayouts()
        pack_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.name}-pack")
        transfer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.name}-xfer")
        # Delta updates only (its thread starts at the first use): the sender hashes its kept buckets there, off the
        # pack thread.
        digest_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.name}-digest")
        self._pools = (pack_pool, transfer_pool, digest_pool)
        # Any engine takes tensors on the host or on this process's accelerator (core stages between them and the
        # transport's buffers); ``devices`` says where the transport's own buffers may live.
        self._accepted = self.devices | accepted_devices()
        self._send = SendPipeline(self.settings, self._accepted, self._policy, self._tracer, pack_pool,
                                  transfer_pool, digest_pool)
        self._receive = ReceiveContext(self.settings, tracer=self._tracer, pool=transfer_pool)

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def prepare(self) -> WorkerMetadata:
        self._check_open()
        metadata = self.settings.metadata()
        metadata.update(self.transport.prepare())
        return metadata

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        return cls.transport_class.build_topology(
            actor_wg_world_size=actor_wg_world_size, rollout_world_size=rollout_world_size, metadata=metadata)

    def init_process_group(self, *, rank_args: RankArgs) -> None:
        self._check_open()
        who = f"{self.name} {self.settings.self_name}"
        plan: RankPlan = decode_plan(rank_args, self.transport_class.plans, who=who)
        if not plan.epoch:
            raise TopologyError(f"{self.name}: rank_args carry no membership epoch", field="$.epoch")
        self._abandon_in_flight()
        self._disconnect()
        self._sender_rank = plan.sender
        self._stripe = plan.striping
        self._one_stripe = plan.one_stripe
        self._send.delta.allowed_base = plan.delta_base  # the manager's: the version every receiver holds
        self._parts = [self._layouts.of(part) for part in plan.parts]
        self._stream = StreamPlan(plan.parts_only, frozenset(plan.skip), plan.blocked, plan.carry)
        self._part = self._layouts.of(plan.part) if plan.part is not None else None
        self._sources = plan.streams
        if plan.role == "sender":
            connected = self.transport.connect_sender(plan)
            self._sender = checked_sender(connected) if self._check_transport else connected
        elif plan.role == "receiver":
            receiver = self.transport.connect_receiver(plan)
            self._receiver = CheckedReceiver(receiver, stable=self.settings.after_receive is None,
                                             hold=self._check_hold) if self._check_transport else receiver
        self._role = plan.role
        self._epoch = plan.epoch

    def _abandon_in_flight(self) -> None:
        """A new epoch supersedes an update still in flight here (its manager gave up on it: timeout, cancellation,
        a dead peer). Closing the transports makes its blocked transport calls fail now instead of at their
        deadline; a call already blocked in a collective ends at its own deadline, one ``timeout`` at most."""
        if self._handover.in_flight:
            self._disconnect()
            self._handover.wait_idle(self.settings.timeout + 5.0)

    def finalize(self) -> None:
        """Nothing of the pipeline outlives an update except buffers and connections, which are kept."""
        self._check_open()

    def held(self) -> object:
        """What this engine holds across updates as a receiver (its delta state; ``worker.host.HoldsAcrossUpdates``)."""
        return self._receive.delta

    def held_weights(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]] | None:
        """The version this engine's receiver keeps a whole copy of, and its tensors (``worker.host.ServesHeld``);
        None when it keeps none (a full-update receiver, one whose sink copies into its own tensors, or one of
        several senders' streams)."""
        delta = self._receive.delta
        return delta.held_weights() if isinstance(delta, ReceiverDelta) else None

    def adopt_held(self, held: object) -> None:
        """Take over ``held``, a previous engine's of this worker (its rank changed, nothing else), where this engine
        keeps the same kind of state."""
        if self._receive.delta is not None and type(held) is type(self._receive.delta):
            self._receive.delta = held

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._disconnect()
        self.transport.release()
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    def _disconnect(self) -> None:
        sender, receiver = self._sender, self._receiver
        self._sender = self._receiver = None
        self._epoch = None
        self._role = None
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()

    def _require(self, role: RankRole, what: str) -> None:
        self._check_open()
        if self._epoch is None:
            raise LifecycleError(f"{what} before init_process_group on this {self.name} engine")
        if role == "receiver" and self._role != "receiver":
            raise LifecycleError(f"{what} on a rank whose role in this topology is {self._role}")

    def enable_tracing(self) -> list[dict[str, Any]]:
        """Record Chrome-trace spans of every bucket's stages (see :class:`weightsync.core.pipeline.trace.Tracer`)."""
        return self._tracer.enable()

    @property
    def trace_events(self) -> list[dict[str, Any]] | None:
        return self._tracer.events

    @trace_events.setter
    def trace_events(self, events: list[dict[str, Any]] | None) -> None:
        self._tracer.events = events

    @property
    def epoch(self) -> str | None:
        return self._epoch

    @property
    def role(self) -> RankRole | None:
        return self._role

    # -- the update ------------------------------------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int = 0) -> TransferReport:
        self._require("sender", "send_weights")
        self._handover.acquire_for("send_weights")
        started = time.perf_counter()
        try:
            if self._role != "sender" or self._sender is None:
                return await drain(weights, devices=self._accepted, rank=self.settings.context.rank, version=version,
                                   started=started)
            self._policy.begin_send()
            try:
                return await self._send.send(self._sender, weights, epoch=self._epoch or "", version=version,
                                             started=started, stripe=self._stripe, parts=self._parts,
                                             stream=self._stream)
            finally:
                self._policy.end_send()
        finally:
            self._handover.release()

    def receive_weights(self) -> ReceivedWeights:
        self._require("receiver", "receive_weights")
        if self._one_stripe:
            raise LifecycleError(f"{self.name}: this rank holds stripe {self._stripe[0]} of {self._stripe[1]} of a "
                                 "staged update: it stages its stripe (stage_weights), it cannot receive the update")
        if self._receiver is None or self._epoch is None:
            raise LifecycleError(f"{self.name}: receive_weights on a rank that is not connected as a receiver")
        hold = self._handover.hold_for_stream()
        reader = self._reader(self._sources, self._policy.new_digest, stripes=self._stripe[1])
        return ReceiveStream(self._receive, self._receiver, hold, epoch=self._epoch,
                             peer=self.transport.peer_name(self._sender_rank), reader=reader)

    # -- a staged update (SyncConfig.staged): the stage phase on a host's stager, the swap on every worker ------------

    async def stage_weights(self, area: StageArea, *, version: int) -> StagedUpdate:
        """Receive update ``version`` into ``area`` (this worker is its host's stager), the digest checked on the
        staged bytes (:mod:`weightsync.core.pipeline.staged`); nothing reaches a model. Holds the engine until the
        receiving thread is done, even if the caller stops waiting."""
        self._require("receiver", "stage_weights")
        if self._stripe[1] > 1 and not self._one_stripe:
            raise ConfigError(f"{self.name}: this rank reads all {self._stripe[1]} stripes of an update; a staged "
                              "update gives each of a host's stagers one stripe (build the topology from metadata "
                              "that says staged)")
        receiver, epoch = self._receiver, self._epoch
        if receiver is None or epoch is None:
            raise LifecycleError(f"{self.name}: stage_weights on a rank that is not connected as a receiver")
        self._handover.acquire_for("stage_weights")
        work = functools.partial(self._stage, receiver, area, epoch=epoch, version=version)
        try:
            future = self._pools[1].submit(work)
        except BaseException:
            self._handover.release()
            raise
        future.add_done_callback(lambda _: self._handover.release())
        return await asyncio.wrap_future(future)

    def _stage(self, receiver: ReceiverTransport, area: StageArea, *, epoch: str, version: int) -> StagedUpdate:
        try:
            return stage_update(receiver, area, settings=self.settings, epoch=epoch, version=version,
                                peer=self.transport.peer_name(self._sender_rank), tables=self._receive.tables,
                                stripe=self._stripe, sources=self._sources)
        except BaseException:
            receiver.close()  # tells the peers now, not at their deadline; the next update joins a new epoch
            raise

    def receive_staged(self, staged: StagedUpdate) -> ReceivedWeights:
        """The update a host's stager staged (``staged``), as a stream read in place from the staging area (a
        striped update's: from its stagers' areas, ``staged.stripes``): the same receive pipeline as
        ``receive_weights`` (destinations, fallbacks, delta apply, the digest checked again on what is read). Any
        role of the current epoch may read it."""
        self._check_open()
        if self._epoch is None:
            raise LifecycleError(f"receive_staged before init_process_group on this {self.name} engine")
        parts, sources = staged.stripes, staged.sources
        receiver: ReceiverTransport = StagedReceiver(staged)
        if parts and sources:  # a sharded actor_wg's streams, each staged into an area of its own
            receiver = SourcesReceiver([StagedReceiver(part) for part in parts], sources, epoch=staged.epoch)
        elif parts:
            receiver = StripedReceiver([StagedReceiver(part) for part in parts], epoch=staged.epoch)
        hold = self._handover.hold_for_stream()
        # The staged bytes are on the host; a striped update's, one area per stripe, read in bucket order.
        reader = self._reader(sources, UpdateDigest, stripes=len(parts) if parts and not sources else 1)
        return ReceiveStream(self._receive, receiver, hold, epoch=staged.epoch, release_early=False,
                             peer=f"{self.transport.peer_name(self._sender_rank)} (staged)", reader=reader)


    def _reader(self, sources: tuple[int, ...], digest: Callable[[], UpdateDigest], *, stripes: int = 1
                ) -> BucketReader:
        """The reader of an update from one sender, from every sender of a sharded ``actor_wg`` (``sources``), or
        dealt into ``stripes``: each bucket then folded into its own sender's (stripe's) digest and sums. Verified by
        this worker's part where it declared one."""
        part, context = self._part, self._receive
        if stripes > 1:
            return BucketReader(StripedDigest(stripes), context.plans, gather=context.gather,
                                part=StripesSums(part, stripes) if part is not None else None)
        if not sources:
            return BucketReader(digest(), context.plans, gather=context.gather,
                                part=PartSums(part) if part is not None else None)
        return BucketReader(SourcesDigest(sources, make=digest), context.plans, gather=context.gather,
                            part=SourcesSums(part, sources) if part is not None else None, sources=True)


def engine_class(transport: type[Transport], *, name: str | None = None) -> type[BucketCheckpointEngine]:
    """The engine class of a backend: :class:`BucketCheckpointEngine` built with ``transport``.

    The class carries the transport's name, devices, options and default slots, and is named after it
    (``ShmTransport`` → ``ShmCheckpointEngine``), in the transport's module, so the registry can name it.
    """
    class_name = transport.__name__.removesuffix("Transport") + "CheckpointEngine"
    namespace = {
        "name": name or transport.name, "devices": transport.devices, "option_names": transport.option_names,
        "default_slots": transport.default_slots, "transport_class": transport, "__module__": transport.__module__,
        "__qualname__": class_name, "__doc__": transport.__doc__,
    }
    return type(class_name, (BucketCheckpointEngine,), namespace)


def guard_build_topology(function: Any) -> Any:
    """Give a ``build_topology`` the runtime guard against the old calling conventions, the size check, and the
    epoch stamp.

    mypy already rejects ``trainer_world_size=`` and positional calls; untyped callers get a ``TypeError`` that
    names the new keyword and ``weightsync migrate`` instead of Python's generic message. The wrapper keeps the
    original signature (``functools.wraps``), so introspection still sees keyword-only parameters.
    """
    @functools.wraps(function)
    def build_topology(cls: type, *args: Any, **kwargs: Any) -> Any:
        reject_renamed_keywords(f"{cls.__name__}.build_topology", kwargs)
        if args:
            raise TypeError(
                f"{cls.__name__}.build_topology takes keyword arguments only: "
                "build_topology(actor_wg_world_size=..., rollout_world_size=..., metadata=...)"
            )
        metadata = kwargs.get("metadata")
        actor, rollout = kwargs.get("actor_wg_world_size"), kwargs.get("rollout_world_size")
        if isinstance(metadata, WorldMetadata) and actor is not None and rollout is not None:
            try:
                check_sizes(actor_wg_world_size=actor, rollout_world_size=rollout, metadata=metadata)
            except TopologyError as exc:
                raise TopologyError(f"{cls.__name__}.build_topology: {exc}") from None
        topology = function(cls, **kwargs)
        return with_epoch(topology) if isinstance(topology, Topology) else topology

    build_topology._weightsync_guarded = True  # type: ignore[attr-defined]
    return build_topology


# Every engine class gets the guard through the base's build_topology (the class is passed in, so errors name it).
setattr(BucketCheckpointEngine, "build_topology",
        classmethod(guard_build_topology(vars(BucketCheckpointEngine)["build_topology"].__func__)))


class PartLayouts:
    """Part layouts by their regions, kept across epochs (each engine has one): a membership change rarely changes
    the parts, and a model's runs and steps cost a pass over every row of every column block to find."""

    def __init__(self, most: int = 32) -> None:
        self._known: dict[bytes, PartLayout] = {}
        self._most = most

    def of(self, plan: PartPlan) -> PartLayout:
        """A layout for ``plan`` (a new epoch's), with what was found for the same regions before."""
        key = plan.key()
        layout = self._known[key] = PartLayout(plan, self._known.pop(key, None))
        while len(self._known) > self._most:  # the least recently used first
            del self._known[next(iter(self._known))]
        return layout
