from __future__ import annotations

import pytest

from weightsync.api.errors import EpochMismatchError, WireError
from weightsync.core.codec import TensorMeta
from weightsync.core import codec


def header(**changes: object) -> codec.BucketHeader:
    meta = TensorMeta(name="w", dtype="float32", shape=(2, 3), offset=0, nbytes=24, total_nbytes=24)
    fields: dict[str, object] = dict(wire=codec.WIRE_VERSION, epoch="e1", version=1, sender=0, index=0, slot=0,
                                     nbytes=24, tensors=[meta])
    fields.update(changes)
    return codec.BucketHeader(**fields)  # type: ignore[arg-type]


def test_round_trip() -> None:
    assert codec.decode_header(codec.encode(header()), epoch="e1", capacity=1024) == header()


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        (codec.encode(header(wire=99)), WireError, "wire version"),
        (codec.encode(header(epoch="other")), EpochMismatchError, "epoch"),
        (codec.encode(header(nbytes=5000)), WireError, "does not fit"),
        (codec.encode(header(tensors=[TensorMeta(name="w", dtype="evil", shape=(1,), offset=0, nbytes=1,
                                                 total_nbytes=1)])), WireError, "unknown dtype"),
        (codec.encode(header(tensors=[TensorMeta(name="w", dtype="float32", shape=(2,), offset=0, nbytes=8,
                                                 total_nbytes=12)])), WireError, "do not match"),
        (codec.encode(header(tensors=[TensorMeta(name="w", dtype="float32", shape=(6,), offset=0, nbytes=24,
                                                 total_nbytes=24, bucket_offset=16)])), WireError, "outside"),
        (b"\x93\x01\x02", WireError, "malformed"),
        (codec.encode(codec.Ack(wire=1, epoch="e1", rank=0, index=1)), WireError, "malformed"),
    ],
)
def test_invalid_headers_are_rejected(message: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        codec.decode_header(message, epoch="e1", capacity=1024)
