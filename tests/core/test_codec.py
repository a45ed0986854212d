from __future__ import annotations

import pytest

from weightsync.api.errors import EpochMismatchError, WireError
from weightsync.core.wire import codec
from weightsync.core.wire.codec import TensorMeta


def header(**changes: object) -> codec.BucketHeader:
    meta = TensorMeta(name="w", dtype="float32", shape=(2, 3), offset=0, nbytes=24, total_nbytes=24)
    fields: dict[str, object] = dict(wire=codec.WIRE_VERSION, epoch="e1", version=1, sender=0, index=0, slot=0,
                                     nbytes=24, tensors=[meta])
    fields.update(changes)
    return codec.BucketHeader(**fields)  # type: ignore[arg-type]


def test_round_trip() -> None:
    assert codec.decode_bucket(codec.encode(header()), epoch="e1", capacity=1024)[0] == header()


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
        codec.decode_bucket(message, epoch="e1", capacity=1024)


def test_encode_bucket_writes_the_bytes_of_the_full_header() -> None:
    full = header(index=3, slot=1)
    table = codec.encode_tensors(full.tensors)
    assert codec.UpdateHeaders(epoch="e1", version=1, sender=0).bucket(index=3, slot=1, nbytes=24, table=table) \
        == codec.encode(full)


def test_a_repeated_table_is_validated_once_and_a_changed_one_again(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    real_check = codec.check_tensor_meta

    def counting(meta: TensorMeta, *, bucket_nbytes: int) -> None:
        checked.append(meta.name)
        real_check(meta, bucket_nbytes=bucket_nbytes)

    monkeypatch.setattr(codec, "check_tensor_meta", counting)
    cache = codec.TableCache()
    message = codec.encode(header())
    first, table = codec.decode_bucket(message, epoch="e1", capacity=1024, cache=cache)
    again, _ = codec.decode_bucket(codec.encode(header(index=1)), epoch="e1", capacity=1024, cache=cache)
    assert checked == ["w"] and first == header() and again == header(index=1)
    assert table == codec.encode_tensors(header().tensors)
    # Another bucket size is another key: its ranges are checked against it.
    with pytest.raises(WireError, match="outside"):
        codec.decode_bucket(codec.encode(header(nbytes=8)), epoch="e1", capacity=1024, cache=cache)
    # A table that differs in one byte is decoded and checked anew, and a bad one still rejected.
    bad = header(tensors=[TensorMeta(name="w", dtype="float32", shape=(2, 3), offset=0, nbytes=24, total_nbytes=28)])
    with pytest.raises(WireError, match="do not match"):
        codec.decode_bucket(codec.encode(bad), epoch="e1", capacity=1024, cache=cache)
    assert checked == ["w", "w", "w"]


def test_the_table_cache_is_bounded() -> None:
    cache = codec.TableCache(limit=100)
    meta = TensorMeta(name="w", dtype="float32", shape=(1,), offset=0, nbytes=4, total_nbytes=4)
    for size in range(10):
        cache.put(bytes(40), size, [meta])
    assert sum(cache.get(bytes(40), size) is not None for size in range(10)) <= 2
