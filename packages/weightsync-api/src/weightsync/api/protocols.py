"""The Protocols that carry weightsync's contract.

Vocabulary
----------
actor worker group (``actor_wg``)
    The training side: ``actor_wg_world_size`` processes (FSDP/Megatron ranks) that together hold the model and can
    each produce a stream of ``(name, tensor)`` pairs. Never called "trainer" here: the trainer is the PPO loop
    that owns the actor worker group, the rollout replicas and much else.
rollout replica / rollout worker
    The inference side: replicas (each one inference engine instance serving requests) made of workers (the
    processes of that instance, e.g. its tensor-parallel ranks). ``rollout_world_size`` counts workers across
    all replicas; rollout rank j is the j-th worker, replica by replica.
membership epoch
    The period during which the set of workers is unchanged. Connections, process groups and registrations live
    as long as an epoch and are rebuilt when it changes; buffers may outlive it.

The lifecycle of one engine (every backend follows it)
------------------------------------------------------
1. ``prepare()`` on every worker of both sides. Allocates (or reuses) buckets, registers memory, opens listening
   endpoints, and returns this worker's metadata: plain data, no pickle.
2. ``build_topology(actor_wg_world_size=..., rollout_world_size=..., metadata=...)`` once, on the driver, as a
   classmethod: decides who sends to whom and returns per-rank arguments.
3. ``init_process_group(rank_args=...)`` on every worker with its own arguments: joins a group, connects peers,
   exchanges the epoch token. All workers of an epoch call it concurrently; it may block until its peers arrive.
4. ``send_weights(weights)`` on every actor rank (the senders transmit, the others drain the stream) and
   ``receive_weights()`` on every rollout worker, concurrently. Repeated once per update while the epoch lasts.
5. ``finalize()`` after each update on every worker: drops what must not outlive an update, keeps what the next
   one reuses (buckets, connections). ``close()`` releases everything (segments unlinked, memory deregistered).

Steps 1-3 run again only when membership changes or after a failed update; a manager that sees the same workers
goes straight from one update's ``finalize`` to the next update's step 4.

Blocking: ``prepare``, ``init_process_group``, ``finalize`` and ``close`` are synchronous and may block (a host runs
them off its event loop). ``send_weights`` and iteration of ``receive_weights`` are asynchronous and never block the
event loop for more than a bucket's bookkeeping: copies and transfers run in worker threads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeGuard, runtime_checkable

from weightsync.api.errors import DestinationError
from weightsync.api.types import (
    RankArgs,
    StagedUpdate,
    Topology,
    TransferReport,
    WorkerContext,
    WorkerMetadata,
    WorldMetadata,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointEngine",
    "ReceivedWeights",
    "BatchedWeights",
    "next_batch",
    "check_destination",
    "copy_stream_into",
    "load_into",
    "ActorWorkerGroup",
    "RolloutWorker",
    "StagingWorker",
    "RolloutReplica",
    "PausableReplica",
    "LoadProvingReplica",
    "TornAwareReplica",
    "WeightSource",
    "WeightSink",
]


@runtime_checkable
class ReceivedWeights(Protocol):
    """The stream ``CheckpointEngine.receive_weights()`` returns: ``async for name, tensor in stream``.

    Ownership: each yielded tensor is a *view* into the engine's receive buffer, valid until the consumer asks for
    the next item (or leaves the loop). A consumer that keeps a tensor copies it (``param.copy_(tensor)``); one
    that keeps the view gets bytes overwritten by a later bucket. Tensors arrive whole (a tensor split across
    buckets is reassembled first), with the sender's dtype and shape, on the engine's device.

    When the stream ends normally, ``report`` holds the receiver's :class:`TransferReport` and the stream has
    already checked the end-to-end digest (a mismatch raises ``DigestMismatchError`` from the last ``__anext__``).
    Errors from the transport surface as ``TransferError`` / ``WireError`` from ``__anext__``.

    A consumer that leaves before the end (a ``break``, an error of its own) calls ``aclose()`` — or iterates under
    ``contextlib.aclosing(stream)``, since a ``break`` alone does not tell an iterator it was left. The update is not
    stalled: the engine receives and drops the rest in the background, whether or not the consumer's event loop runs
again (a worker may drive its own loop one call at a time). A ``receive_weights()`` called meanwhile
    returns a stream that starts once that is done; a second one, or one while a stream is still being consumed,
    raises ``ConcurrentUpdateError``. ``aclose()`` after the end, or twice, does nothing.

    A stream may also say whether ``copy_into`` began writing (a ``wrote`` attribute, True from just before its
    first copy or fallback call): then a failed update that wrote nothing leaves its replica *untouched* whatever
    failed. Without it, every destination ``copy_into`` looked up counts as written, except one whose own check
    failed (the ``DestinationError`` naming it).
    """

    report: TransferReport | None

    def __aiter__(self) -> AsyncIterator[tuple[str, torch.Tensor]]: ...

    async def __anext__(self) -> tuple[str, torch.Tensor]: ...

    async def copy_into(
        self, destinations: Mapping[str, torch.Tensor], *,
        fallback: Callable[[str, torch.Tensor], object] | None = None,
    ) -> int:
        """Consume the rest of the stream, copying each tensor into ``destinations[name]``; return how many tensors
        it consumed.

        The fast way to load an update into tensors that already exist (an inference engine's parameters): an
        engine copies straight from its receive buffers and hashes each piece right behind the copy, so every byte
        is read once. A destination must have the tensor's dtype and shape (``DestinationError`` otherwise, before
        it is written). A tensor with no destination goes to ``fallback(name, view)`` (a view with the lifetime
        ``__anext__`` gives it), or raises ``DestinationError`` when there is none. The end of the stream, the
        digest check and ``report`` are as with ``async for``. ``copy_stream_into`` implements it over ``__anext__``
        for a stream that has nothing faster.
        """
        ...

    async def aclose(self) -> None:
        """Leave the stream before its end (see above); the views it gave are no longer valid."""
        ...


@runtime_checkable
class BatchedWeights(Protocol):
    """An optional capability of a ``ReceivedWeights``: the tensors of one receive buffer at a time.

    ``next_batch()`` returns, at once, the tensors the stream would yield one by one before it moves on to its next
    receive buffer (a bucket), as views valid until the next ``next_batch()`` or ``__anext__`` call, or until the
    consumer leaves; ``None`` at the end, where the digest has been checked and ``report`` is set as with ``async
    for``. A batch may hold less than a whole bucket (an engine that gathers a tensor split across buckets in a
    buffer it reuses ends a batch with it), never nothing before the end. Errors are those of ``__anext__``. The
    two may be mixed: a batch holds what is left of the current buffer.

    For a consumer that keeps tensors a while: an inference engine's loader holds the parts of a fused layer (q and
    k until v arrives) and can copy only what it still holds when it asks for the next batch, rather than every
    tensor, and crosses from the stream's event loop to its own thread once per buffer rather than per tensor.
    """

    async def next_batch(self) -> list[tuple[str, torch.Tensor]] | None: ...


_BATCHED: dict[type, bool] = {}  # by type: a runtime protocol check costs tens of microseconds, asked per batch


def _is_batched(weights: object) -> TypeGuard[BatchedWeights]:
    known = _BATCHED.get(type(weights))
    if known is None:
        known = _BATCHED[type(weights)] = isinstance(weights, BatchedWeights)
    return known


async def next_batch(weights: AsyncIterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]] | None:
    """The next batch of ``weights``: its own ``next_batch()`` (``BatchedWeights``), or one tensor from a stream
    without batches; None at the end."""
    if _is_batched(weights):
        return await weights.next_batch()
    try:
        return [await weights.__anext__()]
    except StopAsyncIteration:
        return None


async def load_into(
    weights: AsyncIterator[tuple[str, torch.Tensor]], destinations: Mapping[str, torch.Tensor], *,
    fallback: Callable[[str, torch.Tensor], object] | None = None,
) -> int:
    """What a ``WeightSink`` calls to load an update into tensors it already has: the stream's own ``copy_into``
    when it is a ``ReceivedWeights`` (the engine's fast path), else ``copy_stream_into``."""
    copy_into = getattr(weights, "copy_into", None)
    if copy_into is not None:
        return int(await copy_into(destinations, fallback=fallback))
    return await copy_stream_into(weights, destinations, fallback=fallback)


def check_destination(name: str, dtype: torch.dtype, shape: Sequence[int], destination: torch.Tensor) -> None:
    """``DestinationError`` (before anything is written) unless ``destination`` has the received tensor's ``dtype``
    and ``shape``. Every copy into destinations checks with this: the engine's ``copy_into`` and the plain one."""
    if destination.dtype != dtype or tuple(destination.shape) != tuple(shape):
        raise DestinationError(
            f"received tensor {name!r} is {str(dtype).removeprefix('torch.')}{list(shape)}, its destination "
            f"{str(destination.dtype).removeprefix('torch.')}{list(destination.shape)}", name=name,
        )


async def copy_stream_into(
    stream: AsyncIterator[tuple[str, torch.Tensor]], destinations: Mapping[str, torch.Tensor], *,
    fallback: Callable[[str, torch.Tensor], object] | None = None,
) -> int:
    """``ReceivedWeights.copy_into`` over plain iteration: ``destinations[name].copy_(tensor)`` per tensor (outside
    autograd, so a model's parameters are valid destinations)."""
    import torch  # only here: whoever hands us tensors has torch

    count = 0
    async for name, tensor in stream:
        destination = destinations.get(name)
        if destination is None:
            if fallback is None:
                raise DestinationError(f"no destination for received tensor {name!r} (and no fallback)", name=name)
            fallback(name, tensor)
        else:
            check_destination(name, tensor.dtype, tensor.shape, destination)
            with torch.no_grad():
                destination.copy_(tensor)
        count += 1
    return count


@runtime_checkable
class CheckpointEngine(Protocol):
    """Moves one model's weights from the actor worker group to every rollout worker.

    One instance lives in each worker process (actor rank or rollout worker), built by the hosting adapter as
    ``Engine(bucket_bytes=..., context=..., slots=..., timeout=..., verify_digest=..., **options)``: ``context``
    (a ``WorkerContext``: role, rank, node, address, supplied by the host), ``slots`` (buckets per side; ``None``:
    the backend's default), ``timeout`` (seconds any single blocking wait may take), ``verify_digest`` (check the
    end-to-end digest on receipt). With ``SyncConfig.delta`` the adapters add ``delta=True`` and ``verify_every``
    (send only what changed, see ``weightsync.core.delta``); an engine that cannot raises ``ConfigError`` for them.
    Backends document their own ``options``.

    Class attributes (data, read without constructing an engine): ``name`` (the registry name), ``devices``
    (where the backend's own buffers can live, e.g. ``frozenset({"cpu"})``; ``{"cuda"}`` for a backend that needs
    CUDA), and its capabilities: ``supports_delta`` (whether it takes ``delta=True``), ``checks_transport_rules``
    (whether it takes ``check_transport=True``: the conformance kit then builds it so, and every case also checks
    the rules between its pipeline and its transport) and ``verifies_parts`` (whether its rank arguments may carry
    the parts rollout workers declared, ``weightsync.api.parts``: then a worker that declared one verifies its part
    alone; an engine that does not verifies every worker's whole model).

    Devices: every engine accepts source tensors on the host or on the calling process's accelerator (its current
    device), mixed within one update, and loads into destinations on either; where a tensor's device differs from
    the engine's buffers the engine stages it, asynchronously and without a device-wide synchronize. A tensor on any
    other device raises ``UnsupportedDeviceError``.

    Errors: a bad argument raises at the call (``ConfigError``, ``WeightStreamError`` subclasses); calling a step
    out of order raises ``LifecycleError``; a peer that misbehaves raises ``TransferError`` naming it; bytes from a
    peer that do not decode raise ``WireError`` (and are never used).
    """

    name: ClassVar[str]
    devices: ClassVar[frozenset[str]]
    supports_delta: ClassVar[bool]
    checks_transport_rules: ClassVar[bool]
    verifies_parts: ClassVar[bool]

    def __init__(
        self, *, bucket_bytes: int, context: WorkerContext | None = None, slots: int | None = None,
        timeout: float = 600.0, verify_digest: bool = True, **options: Any,
    ) -> None: ...

    def prepare(self) -> WorkerMetadata:
        """Step 1. Allocate or reuse buffers and endpoints; return this worker's metadata (plain data).

        Idempotent: calling it again without ``close()`` reuses what exists and returns equivalent metadata.
        """
        ...

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        """Step 2, on the driver. Decide the transfer topology from every worker's metadata.

        Must return exactly ``actor_wg_world_size`` actor entries and ``rollout_world_size`` rollout entries; raise
        ``TopologyError`` if the workers cannot be served by this backend (e.g. shared memory across nodes), naming
        the workers involved.
        """
        ...

    def init_process_group(self, *, rank_args: RankArgs) -> None:
        """Step 3. Join the epoch described by ``rank_args`` (this rank's entry of the topology).

        Tears down connections of a previous epoch first. May block until peers have joined; gives up with
        ``TransferError`` (naming the missing peer) after the deadline in ``rank_args`` or the engine's timeout.
        """
        ...

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> TransferReport:
        """Step 4, actor side. Consume ``weights`` entirely and, on a sending rank, transmit it as update ``version``.

        ``version`` labels the update (the manager's counter, or the trainer's step): it travels in every bucket
        header, and each receiver's report carries it.

        ``weights`` may be a generator that gathers a sharded model collectively, so every actor rank must drain
        it even when it sends nothing. Each tensor is read during this call only (packed into a bucket); the caller
        keeps ownership. Validation (duplicate names, unsupported dtype or device, a non-tensor item) raises a
        ``WeightStreamError`` subclass, and receivers are told the update was aborted. Returns this rank's report
        with the digest of what it sent.
        """
        ...

    def receive_weights(self) -> ReceivedWeights:
        """Step 4, rollout side. Return the stream of this update's ``(name, tensor)`` pairs (see ReceivedWeights)."""
        ...

    def finalize(self) -> None:
        """Step 5. Release per-update state; keep buffers and connections for the next update of this epoch."""
        ...

    def close(self) -> None:
        """Release everything: connections, process groups, registrations, shared segments. Idempotent."""
        ...


@runtime_checkable
class ActorWorkerGroup(Protocol):
    """The actor (training) side as the driver sees it: ``world_size`` ranks, addressed all at once.

    Both methods start work on every rank and return at once with one awaitable per rank, in rank order; awaiting
    one yields that rank's result or raises its error. A Ray ``ObjectRef`` is such an awaitable, so a Ray worker
    group returns its refs as they are. The manager awaits them with a timeout and never blocks its event loop.
    """

    @property
    def world_size(self) -> int: ...

    def execute_checkpoint_engine(self, method: str, /, **per_rank_kwargs: Sequence[Any]) -> Sequence[Awaitable[Any]]:
        """Call ``method`` on every rank's engine host; each keyword's value is a list with one entry per rank.

        ``method`` is one of ``"prepare"`` (keyword ``engine``: the backend name and ``SyncConfig`` as plain data;
        the host builds or reuses its engine and returns ``prepare()``'s metadata), ``"init_process_group"``
        (keyword ``rank_args``), ``"finalize"``, ``"close"`` and ``"ping"`` (answer at once, even mid-transfer, with
        where the worker runs; the manager pings workers that missed a step's deadline, to tell an unreachable host
        from a worker that is only waiting for one: a host that answers with an error still counts as reachable).
        """
        ...

    def update_weights(self, *, version: int) -> Sequence[Awaitable[TransferReport]]:
        """On every rank: ``send_weights`` of that rank's current model; each awaitable yields its report."""
        ...


@runtime_checkable
class RolloutWorker(Protocol):
    """One inference process of a replica, hosting an engine and a :class:`WeightSink`."""

    @property
    def name(self) -> str:
        """A human-readable identity used in error messages (e.g. ``replica1/worker0@node3``)."""
        ...

    def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Awaitable[Any]:
        """As ``ActorWorkerGroup.execute_checkpoint_engine``, for this one worker (plain keyword values)."""
        ...

    def update_weights(self, *, version: int) -> Awaitable[TransferReport]:
        """Feed ``receive_weights()`` into the worker's sink; yields the receiver's report once verified."""
        ...


@runtime_checkable
class StagingWorker(Protocol):
    """Optional, on a ``RolloutWorker``: the two phases of a staged update (``SyncConfig(staged=True)``).

    The manager picks one worker per host as that host's stager. ``stage_weights`` runs on the stagers while every
    replica serves: the worker's engine receives the whole update into the host's staging area (shared memory, one
    per host, kept between updates) and checks the update's digest on the staged bytes; a failure (a sender that
    died, a link down, a digest mismatch) leaves every worker's model as it was. ``apply_staged`` runs on every
    worker of a replica once the manager has paused it: the staged update goes into the worker's sink exactly as
    ``update_weights`` feeds a received one (the same destinations, delta apply and digest check). Neither call may
    block the worker's event loop.
    """

    def stage_weights(self, *, version: int) -> Awaitable[StagedUpdate]:
        """Receive update ``version`` into this host's staging area; yields where it lies, once verified there."""
        ...

    def apply_staged(self, *, version: int, staged: StagedUpdate) -> Awaitable[TransferReport]:
        """Feed the update staged on this worker's host (``staged``, the host stager's answer) into the sink;
        yields the receiver's report once verified, as ``update_weights`` does."""
        ...


@runtime_checkable
class RolloutReplica(Protocol):
    """One inference engine instance: its workers, and the hooks the manager calls around an update.

    The manager pauses a replica before any byte moves (``abort_all_requests`` then ``release_kv_cache``) and
    resumes it afterwards (``resume_kv_cache`` then ``resume_generation``) — only if it holds a complete, verified
    model. Each hook is idempotent and may be called on a replica that is already in the target state.
    """

    @property
    def workers(self) -> Sequence[RolloutWorker]: ...

    async def abort_all_requests(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def resume_generation(self) -> None: ...


@runtime_checkable
class PausableReplica(Protocol):
    """Optional, on a ``RolloutReplica``: a whole pause (``abort_all_requests`` then ``release_kv_cache``) or resume
    (``resume_kv_cache`` then ``resume_generation``) in one call, hence one round trip to its workers. The manager
    uses these when a replica has them, the four hooks otherwise."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...


@runtime_checkable
class LoadProvingReplica(Protocol):
    """Optional, on a ``RolloutReplica`` whose inference engine can hash what it holds (vLLM's
    ``compute_weight_checksums``): after an update the manager compares every committed replica's checksums, per
    parameter, and a replica that disagrees with the majority is torn (``LoadVerificationError`` naming it and the
    parameter). This proves the engine *loaded* what weightsync delivered, which the transfer digest cannot: the
    digest covers the bytes up to the engine's loader, the checksums what the loader made of them."""

    async def weight_checksums(self) -> Mapping[str, str]:
        """Parameter name → a hash of that parameter's bytes as the engine holds it now."""
        ...


@runtime_checkable
class TornAwareReplica(Protocol):
    """Optional, on a ``RolloutReplica``: ``torn(reason)`` is called, instead of resuming, on a replica an update left
    torn, so that it can end the requests it kept across the pause (they cannot continue on a half-loaded model)
    with an error naming ``reason``. The replica stays paused."""

    async def torn(self, reason: str) -> None: ...


@runtime_checkable
class WeightSource(Protocol):
    """What an actor rank sends: its current model as ``(name, tensor)`` pairs (see ``send_weights``)."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]: ...


@runtime_checkable
class WeightSink(Protocol):
    """What a rollout worker does with a received stream: typically copy each tensor into its model.

    The tensors are views valid until the next item is requested (see ReceivedWeights): copy, do not keep.
    """

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None: ...
