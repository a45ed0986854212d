"""The wire codec: versioned, typed messages encoded with msgpack (msgspec), validated on receipt. No pickle.

Every message a peer sends us is decoded into a fixed schema and checked before anything acts on it: a wrong wire
version, a foreign membership epoch, a dtype we do not know, a range outside the bucket — each is a ``WireError``
(``EpochMismatchError`` for the epoch), and the bytes are dropped.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

import msgspec

from weightsync.api.errors import EpochMismatchError, WireError
from weightsync.core.wire.blocks import check_blocks
from weightsync.core.wire.tensors import DTYPES

__all__ = [
    "WIRE_VERSION",
    "NO_SLOT",
    "MAX_NAME_BYTES",
    "MAX_TENSORS_PER_BUCKET",
    "TensorMeta",
    "BucketHeader",
    "StreamEnd",
    "Hello",
    "Ack",
    "encode",
    "decode_bucket",
    "UpdateHeaders",
    "TableCache",
    "decode_hello",
    "decode_ack",
    "encode_tensors",
]

WIRE_VERSION = 4
NO_SLOT = -1
"""Slot of a message without payload (the final and abort markers)."""
MAX_NAME_BYTES = 1024
MAX_TENSORS_PER_BUCKET = 1 << 16
MAX_DIMS = 32
_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}


class TensorMeta(msgspec.Struct, frozen=True, array_like=True, gc=False, omit_defaults=True):
    """One tensor, or one contiguous byte range of one tensor, as carried in a bucket's table.

    A tensor larger than a bucket travels as several entries with the same ``name`` and increasing ``offset``; the
    receiver yields the tensor once it holds all ``total_nbytes`` bytes. ``dtype`` is the torch dtype's name without
    the ``torch.`` prefix (``"bfloat16"``); ``shape`` is the full tensor's shape; bytes are the tensor's contiguous
    row-major bytes. Encoded as a msgpack array (no field names on the wire): a table of 10,000 small tensors stays
    small and decodes in milliseconds.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset of this range within the full tensor's bytes."""
    nbytes: int
    """Length of this range in bytes."""
    total_nbytes: int
    """Bytes of the whole tensor (``numel * element_size``)."""
    bucket_offset: int = 0
    """Where this range starts inside its bucket."""
    blocks: tuple[int, ...] = ()
    """``(dim, count)`` when the tensor's bytes are not row-major but ``count`` equal blocks along ``dim`` one after
    the other (each block's bytes row-major: :mod:`weightsync.core.wire.blocks`); ranges are of those bytes. Empty
    (and not on the wire) for the tensor's own order."""
    span: tuple[int, ...] = ()
    """``(first, end)``: the only bytes of the tensor (in the order it travels) this stream carries, where it carries
    less than the whole: its receivers hold only regions inside them (a part group's carrier, guide: parts). Empty
    (and not on the wire) for a stream that carries the whole tensor."""

    @property
    def is_whole(self) -> bool:
        return self.offset == 0 and self.nbytes == self.total_nbytes

    @property
    def carried(self) -> int:
        """The bytes of the tensor its stream carries: the whole, or its ``span``'s."""
        return self.span[1] - self.span[0] if self.span else self.total_nbytes

    @property
    def completes(self) -> bool:
        """Whether this range is the last of the tensor's its stream carries."""
        return self.offset + self.nbytes == (self.span[1] if self.span else self.total_nbytes)


class StreamEnd(msgspec.Struct, frozen=True, array_like=True):
    """One sender's end of its stream, as a receiver of several senders (a sharded ``actor_wg``) keeps it in the
    final header it merges from theirs (:class:`BucketHeader`'s ``ends``)."""

    sender: int
    index: int
    """How many buckets the sender's stream held."""
    base: int
    model: str


class _BucketFields(msgspec.Struct, frozen=True, tag="bucket"):
    """What a bucket header says besides its table (the two forms below add the table)."""

    wire: int
    epoch: str
    version: int
    sender: int
    index: int
    slot: int
    nbytes: int
    final: bool = False
    digest: str = ""
    abort: str = ""
    base: int = -1
    """A delta update's base version (every bucket of the update carries it), -1 for a full update."""
    base_model: str = ""
    """The model digest of ``base`` (what a receiver must hold to apply the update's deltas)."""
    dense: int = -1
    """For a delta bucket: its dense size, the layout its table describes (``nbytes`` is the encoding's); -1 for a
    bucket whose payload is its dense bytes."""
    model: str = ""
    """On the final header of an update of a delta-enabled sender: the model digest of the version it completes."""
    parts: list[bytes] = []
    """On the final header of a full update whose receivers declared parts: each distinct part's sums, in the
    order of the senders' plan (:mod:`weightsync.core.wire.parts`)."""
    part_models: list[str] = []
    """On the final header of an update of a delta-enabled sender whose receivers declared parts: each distinct
    part's model digest, in the order of the senders' plan (:mod:`weightsync.core.delta.parts`)."""
    ends: list[StreamEnd] = []
    """On the final header a receiver of several senders merges from theirs (no sender sends it): each sender's end,
    in the senders' order (its delta state is per sender: :mod:`weightsync.core.delta.sources`)."""


class BucketHeader(_BucketFields, frozen=True, tag="bucket", kw_only=True):
    """Announces one bucket (or the end of an update: ``final``; or its failure: ``abort``)."""

    tensors: list[TensorMeta]


class _TableHeader(_BucketFields, frozen=True, tag="bucket", kw_only=True):
    """``BucketHeader`` on the wire, its table left as the encoded bytes: the sender writes the table it already
    encoded for the digest, and a receiver looks it up before decoding it (see ``TableCache``)."""

    tensors: msgspec.Raw


class TableCache:
    """Bucket tables this receiver decoded and validated, keyed by their bytes and their bucket's size.

    Each update of a model carries the tables of the update before (names, dtypes, shapes and places do not change),
    so a receiver decodes and checks each once: a table of 1,024 small tensors costs a millisecond to decode and
    validate, and microseconds to look up. Only byte-identical tables hit, so what a peer sends is never trusted
    beyond what was validated. Bounded: cleared once it holds ``limit`` bytes of tables (the decoded entries take a
    few times that).
    """

    def __init__(self, limit: int = 32 << 20) -> None:
        self.limit = limit
        self._tables: dict[tuple[bytes, int], list[TensorMeta]] = {}
        self._bytes = 0

    def get(self, table: bytes, bucket_nbytes: int) -> list[TensorMeta] | None:
        return self._tables.get((table, bucket_nbytes))

    def put(self, table: bytes, bucket_nbytes: int, tensors: list[TensorMeta]) -> None:
        if self._bytes + len(table) > self.limit:
            self._tables.clear()
            self._bytes = 0
        self._tables[(table, bucket_nbytes)] = tensors
        self._bytes += len(table)


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """First message on a connection of ours: who is connecting, for which epoch."""

    wire: int
    epoch: str
    rank: int
    info: dict[str, str] = {}


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """A receiver is done with bucket ``index`` (its slot may be reused)."""

    wire: int
    epoch: str
    rank: int
    index: int


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_TableHeader)
_table_decoder = msgspec.msgpack.Decoder(list[TensorMeta])
_hello_decoder = msgspec.msgpack.Decoder(Hello)
_ack_decoder = msgspec.msgpack.Decoder(Ack)
_tensors_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """Encode any of our wire structs (each carries its tag, so a decoder for another type rejects it)."""
    return _encoder.encode(message)


def decode_table(table: bytes) -> list[TensorMeta]:
    """A bucket's table as this side encoded it (a kept copy's: validated when it arrived)."""
    return _table_decoder.decode(table)


def encode_tensors(tensors: Sequence[TensorMeta]) -> bytes:
    """Deterministic bytes of a bucket's tensor table (what the digest covers besides the payload)."""
    return _tensors_encoder.encode(list(tensors))


class UpdateHeaders(msgspec.Struct, frozen=True, kw_only=True):
    """What every header of one update shares — its membership epoch, version and sender, and a delta update's base
    — and the headers made from it."""

    epoch: str
    version: int
    sender: int
    base: int = -1
    base_model: str = ""

    def bucket(self, *, index: int, slot: int, nbytes: int, table: bytes, dense: int = -1) -> bytes:
        """Bucket ``index``'s header around its already encoded table (``encode_tensors``): the bytes of
        ``encode(BucketHeader(..., tensors=<that table's entries>))``, without encoding the entries a second time."""
        return _encoder.encode(_TableHeader(
            wire=WIRE_VERSION, epoch=self.epoch, version=self.version, sender=self.sender, index=index, slot=slot,
            nbytes=nbytes, tensors=msgspec.Raw(table), base=self.base, base_model=self.base_model, dense=dense,
        ))

    def marker(self, *, index: int, final: bool = False, digest: str = "", abort: str = "", base: int = -1,
               model: str = "", parts: list[bytes] | None = None, part_models: list[str] | None = None) -> bytes:
        """A header without payload after ``index`` buckets: the final one (``digest``; a delta-enabled sender's
        ``base``, ``model`` and ``part_models``; the parts' sums), or an abort."""
        return encode(BucketHeader(wire=WIRE_VERSION, epoch=self.epoch, version=self.version, sender=self.sender,
                                   index=index, slot=NO_SLOT, nbytes=0, tensors=[], final=final, digest=digest,
                                   abort=abort, base=base, model=model, parts=parts or [],
                                   part_models=part_models or []))


def _check_common(wire: int, epoch: str, expected_epoch: str | None) -> None:
    if wire != WIRE_VERSION:
        raise WireError(f"the peer speaks wire version {wire}, this side speaks {WIRE_VERSION}")
    if expected_epoch is not None and not hmac.compare_digest(epoch.encode(), expected_epoch.encode()):
        raise EpochMismatchError(f"message from membership epoch {epoch[:12]!r}, expected {expected_epoch[:12]!r}")


def decode_bucket(
    data: bytes, *, epoch: str | None, capacity: int, cache: TableCache | None = None
) -> tuple[BucketHeader, bytes]:
    """Decode and validate a bucket header (``capacity``: the receiving bucket's size in bytes); also return its
    table's encoded bytes (what the digest covers).

    ``cache`` holds tables validated before: a byte-identical table (and bucket size) is not decoded again.
    """
    try:
        raw = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed bucket header: {exc}") from None
    _check_common(raw.wire, raw.epoch, epoch)
    if not 0 <= raw.nbytes <= capacity:
        raise WireError(f"bucket of {raw.nbytes} bytes does not fit a {capacity}-byte buffer")
    if raw.index < 0 or raw.version < 0 or raw.sender < 0:
        raise WireError("negative index, version or sender in bucket header")
    if raw.dense >= 0 and (raw.base < 0 or raw.dense > capacity):
        raise WireError(f"delta bucket of {raw.dense} dense bytes (base {raw.base}) for a {capacity}-byte buffer")
    layout = raw.dense if raw.dense >= 0 else raw.nbytes  # what the table's ranges lie in
    table = bytes(raw.tensors)
    tensors = cache.get(table, layout) if cache is not None else None
    if tensors is None:
        try:
            tensors = _table_decoder.decode(table)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(f"malformed bucket header: {exc}") from None
        if len(tensors) > MAX_TENSORS_PER_BUCKET:
            raise WireError(f"bucket lists {len(tensors)} tensors (limit {MAX_TENSORS_PER_BUCKET})")
        for meta in tensors:
            check_tensor_meta(meta, bucket_nbytes=layout)
        if cache is not None:
            cache.put(table, layout, tensors)
    header = BucketHeader(
        wire=raw.wire, epoch=raw.epoch, version=raw.version, sender=raw.sender, index=raw.index, slot=raw.slot,
        nbytes=raw.nbytes, tensors=tensors, final=raw.final, digest=raw.digest, abort=raw.abort, base=raw.base,
        base_model=raw.base_model, dense=raw.dense, model=raw.model, parts=raw.parts, part_models=raw.part_models,
        ends=raw.ends,
    )
    return header, table


def check_tensor_meta(meta: TensorMeta, *, bucket_nbytes: int) -> None:
    """One table entry against the schema's limits and itself (runs per tensor: kept to cheap comparisons)."""
    name, shape, offset, nbytes = meta.name, meta.shape, meta.offset, meta.nbytes
    if not name or len(name) > MAX_NAME_BYTES // 4 and len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise WireError(f"tensor name of invalid length in bucket header: {name[:64]!r}")
    itemsize = _ITEMSIZE.get(meta.dtype)
    if itemsize is None:
        raise WireError(f"unknown dtype {meta.dtype!r} for tensor {name!r}")
    if len(shape) > MAX_DIMS or shape and min(shape) < 0:
        raise WireError(f"invalid shape {shape} for tensor {name!r}")
    expected = math.prod(shape) * itemsize
    if meta.total_nbytes != expected:
        raise WireError(f"tensor {name!r}: {meta.total_nbytes} bytes do not match shape and dtype ({expected})")
    if offset < 0 or nbytes < 0 or offset + nbytes > expected:
        raise WireError(f"tensor {name!r}: range {offset}+{nbytes} outside {expected}")
    if meta.bucket_offset < 0 or meta.bucket_offset + nbytes > bucket_nbytes:
        raise WireError(f"tensor {name!r}: bucket range outside the bucket's {bucket_nbytes} bytes")
    if meta.blocks:
        check_blocks(meta.blocks, shape, name=name)
    if meta.span and (len(meta.span) != 2 or not 0 <= meta.span[0] <= offset
                      or not offset + nbytes <= meta.span[1] <= expected):
        raise WireError(f"tensor {name!r}: range {offset}+{nbytes} outside its span {tuple(meta.span)}")


class _Stamped(Protocol):
    @property
    def wire(self) -> int: ...

    @property
    def epoch(self) -> str: ...


Message = TypeVar("Message", bound=_Stamped)


def decode_message(decoder: msgspec.msgpack.Decoder[Message], data: bytes, *, what: str, epoch: str | None,
                   peer: str = "peer") -> Message:
    """Decode one of our control messages and check its wire version and membership epoch (``WireError``,
    ``EpochMismatchError``); ``what`` and ``peer`` name it in errors."""
    try:
        message = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed {what} from {peer}: {exc}") from None
    _check_common(message.wire, message.epoch, epoch)
    return message


def decode_hello(data: bytes, *, epoch: str | None) -> Hello:
    return decode_message(_hello_decoder, data, what="hello", epoch=epoch)


def decode_ack(data: bytes, *, epoch: str | None) -> Ack:
    return decode_message(_ack_decoder, data, what="ack", epoch=epoch)
