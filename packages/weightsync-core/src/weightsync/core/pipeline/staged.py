"""The stage phase of a staged update, on a host's stager: every bucket off the transport into the host's staging
area (:mod:`weightsync.core.transports.stagearea`), as it arrived, and the update's digest over the staged bytes.

Nothing here reads a bucket as tensors or touches a model: a delta bucket is staged encoded, and its base is checked
by each worker when it applies the update in the swap (``ReceiveStream`` over a ``StagedReceiver``). A bucket is
released as soon as it is staged, so the sender and the other receivers never wait for the swap.
"""

from __future__ import annotations

import dataclasses
import time

from weightsync.api.errors import DigestMismatchError, TransferError, WireError
from weightsync.api.types import StagedUpdate, PhaseTiming, TransferReport
from weightsync.core.pipeline.receive import BucketOrder
from weightsync.core.transports.settings import EngineSettings
from weightsync.core.transports.stagearea import StageArea
from weightsync.core.transports.seam import ReceiverTransport
from weightsync.core.wire import codec
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.sources import SourcesDigest

__all__ = ["stage_update"]


def stage_update(receiver: ReceiverTransport, area: StageArea, *, settings: EngineSettings, epoch: str, version: int,
                 peer: str, tables: codec.TableCache, stripe: tuple[int, int] = (0, 1),
                 sources: tuple[int, ...] = ()) -> StagedUpdate:
    """Blocking (a thread of the engine's): receive one update from ``receiver`` into ``area`` and seal it once its
    digest, taken over the staged bytes, equals the sender's. ``stripe``: (s, K), this stager's stripe of a striped
    update (buckets s, s + K, ..., and the stripe's own digest); (0, 1): the whole update. ``sources``: the senders
    of a sharded ``actor_wg``, each bucket folded into its sender's digest (``weightsync.core.wire.sources``). Raises
    ``TransferError`` (an abort, a lost peer, a deadline) or ``DigestMismatchError``; the area is then left
    unsealed."""
    started = time.perf_counter()
    deadline = time.monotonic() + settings.timeout
    digest = SourcesDigest(sources) if sources else UpdateDigest()
    order = BucketOrder(bool(sources))
    area.begin(version=version, epoch=epoch, capacity=receiver.capacity)
    nbytes = wire = buckets = tensors = 0
    first, stripes = stripe
    while True:
        received = receiver.receive(deadline)
        try:
            header, table = codec.decode_bucket(received.header, epoch=epoch, capacity=receiver.capacity,
                                                cache=tables)
            if header.abort:
                raise TransferError(f"{peer} aborted the update: {header.abort}", peer=peer)
            if header.final:
                break
            if sources:
                order.take(header)
                digest.select(header.sender)
            elif header.index != first + buckets * stripes:
                raise WireError(f"bucket {header.index} arrived where bucket {first + buckets * stripes} was expected")
            payload = received.payload[: header.nbytes]
            staged = area.append(received.header, payload if payload.is_cpu else payload.cpu())
            digest.update_bucket(table, staged)  # the bytes as they lie in the area, not as they arrived
            del staged  # a view held across the next append would keep a mapping the area outgrew alive
        finally:
            receiver.release(received.token)
        buckets += 1
        wire += header.nbytes
        tensors += len(header.tensors)
        nbytes += sum(meta.nbytes for meta in header.tensors)
    if len(range(first, header.index, stripes)) != buckets:
        raise WireError(f"{peer}'s final header names {header.index} buckets, of which stripe {first} of {stripes} "
                        f"holds {len(range(first, header.index, stripes))}; {buckets} arrived")
    hexdigest = digest.hexdigest()
    if settings.verify_digest and header.digest != hexdigest:
        raise DigestMismatchError(
            f"rollout rank {settings.context.rank} staged bytes whose digest {hexdigest[:16]} differs from {peer}'s "
            f"{header.digest[:16]}: the update was corrupted on its way to this host's staging area",
            receiver=settings.context.rank, expected=header.digest, actual=hexdigest)
    area.append(received.header, None)
    seconds = time.perf_counter() - started
    report = TransferReport(
        role="rollout", rank=settings.context.rank, version=header.version, nbytes=nbytes, tensors=tensors,
        buckets=buckets, seconds=seconds, digest=hexdigest, sender=header.sender,
        phases=(PhaseTiming(phase="stage", seconds=seconds),), wire_bytes=wire, base=header.base)
    sealed = area.seal(version=version, epoch=epoch, capacity=receiver.capacity, node_id=settings.context.node_id,
                       report=report)
    return dataclasses.replace(sealed, sources=sources) if sources else sealed
