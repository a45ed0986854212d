"""The stage phase of a staged update, on a host's stager: every bucket off the transport into the host's staging
area (:mod:`weightsync.core.transports.stagearea`), as it arrived, and the update's digest over the staged bytes.

Nothing here touches a model: a delta bucket is staged encoded, and its base is checked by each worker when it
applies the update in the swap (``ReceiveStream`` over a ``StagedReceiver``). A bucket is released as soon as it is
staged, so the sender and the other receivers never wait for the swap. :func:`staged_weights` reads a sealed full
update back as tensors, for the stager to serve to a replica that joins (``weightsync.core.control.join``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from weightsync.api.errors import DigestMismatchError, TransferError, WireError
from weightsync.api.types import StagedUpdate, PhaseTiming, TransferReport
from weightsync.core.pipeline.receive import BucketOrder
from weightsync.core.pipeline.unpack import BucketReader, BulkPlans
from weightsync.core.transports.settings import EngineSettings
from weightsync.core.transports.stagearea import StageArea, StagedReceiver
from weightsync.core.transports.seam import Arrived, ReceiverTransport
from weightsync.core.wire import codec
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.sources import SourcesDigest

__all__ = ["stage_update", "staged_weights"]


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


def staged_weights(staged: StagedUpdate, *, tables: codec.TableCache) -> Iterator[tuple[str, torch.Tensor]]:
    """The model a sealed staging area holds (``staged``: a full update staged whole, by this process), tensor by
    tensor in the order it was sent: views of the area, a tensor split across buckets gathered into one of its own.
    Every byte is hashed again as it is read; at the end a ``DigestMismatchError`` if the area no longer holds what
    was staged (the digest in its final header, and in ``staged.report``), a ``WireError`` at the first bucket that
    shows it holds a stripe or a delta, not the model."""
    receiver = StagedReceiver(staged)
    digest = UpdateDigest()
    reader = BucketReader(digest, BulkPlans())
    buckets = 0
    while True:
        received = receiver.receive(float("inf"))
        header, table = codec.decode_bucket(received.header, epoch=staged.epoch, capacity=receiver.capacity,
                                            cache=tables)
        if header.final or header.abort:
            break
        if header.base >= 0 or header.index != buckets:  # a delta's base is not here; a stripe skips buckets
            raise WireError(f"staging area {staged.area} holds {'a delta' if header.base >= 0 else 'a stripe'} of "
                            f"version {staged.version}, not the whole model")
        reader.begin(Arrived(header, received.payload[: header.nbytes], received.token, table, fused=True))
        while reader.pending:
            view = reader.next_view()
            if view is not None:  # a gathered tensor's scratch is overwritten by the next one: a copy of its own
                yield (view[0], view[1].clone()) if reader.gathered else view
        reader.finish()
        buckets += 1
    if header.abort or header.index != buckets:
        raise WireError(f"staging area {staged.area} holds {buckets} of the {header.index} buckets of version "
                        f"{staged.version}, not the whole model")
    if digest.hexdigest() != header.digest or staged.report is not None and staged.report.digest != header.digest:
        raise DigestMismatchError(
            f"staging area {staged.area} no longer holds what was staged: digest {digest.hexdigest()[:16]}, the "
            f"sender's {header.digest[:16]}", expected=header.digest, actual=digest.hexdigest())
