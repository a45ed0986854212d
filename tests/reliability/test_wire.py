"""Wire safety for the sockets weightsync opens itself: no pickle, no network listener, epoch token or nothing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import pickle
import socket
import time
from typing import Any

import psutil
import pytest
import torch

from tests.reliability.test_bad_inputs import Pair, good
from weightsync.api.types import WorkerContext
from weightsync.core.transports.place import default_node_id
from weightsync.core.wire import codec
from weightsync.gloo.collective import GlooCheckpointEngine
from weightsync.shm.engine import ShmCheckpointEngine


def _forbid_pickle(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"pickle.{name} called on the update path")
        return call

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse(name))
    return calls


def test_an_update_uses_no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = Pair()
    calls = _forbid_pickle(monkeypatch)
    try:
        pair.connect()
        sent, received = pair.update(good())
        assert sent is None and received is None and pair.delivered == ["w0", "w1", "w2"]
    finally:
        pair.close()
    assert calls == []


def test_the_pickle_tripwire_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _forbid_pickle(monkeypatch)  # negative control: the tripwire sees a pickle call
    with pytest.raises(AssertionError):
        pickle.dumps({"a": 1})
    assert calls == ["dumps"]


def _listening_tcp(pid: int) -> set[tuple[str, int]]:
    return {(conn.laddr.ip, conn.laddr.port) for conn in psutil.Process(pid).net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN}


def test_shm_opens_no_network_listener() -> None:
    import os

    before = _listening_tcp(os.getpid())
    engine = ShmCheckpointEngine(bucket_bytes=1 << 16, context=WorkerContext(role="actor", rank=0, node_id="n"))
    try:
        metadata = engine.prepare()
        assert _listening_tcp(os.getpid()) == before  # an abstract Unix socket: unreachable from the network
        assert str(metadata["address"]).startswith("weightsync-shm-")
    finally:
        engine.close()


def test_gloo_store_listens_only_on_the_control_plane_address() -> None:
    # Also the negative control of the check above: the listener check does see a TCP listener. torch's TCPStore
    # (gloo's rendezvous) would listen on every interface; the engine binds it to the address it was given.
    import os

    before = _listening_tcp(os.getpid())
    engine = GlooCheckpointEngine(bucket_bytes=1 << 16,
                                  context=WorkerContext(role="actor", rank=0, node_id="n", host_ip="127.0.0.1"))
    try:
        port = engine.prepare()["store_port"]
        added = _listening_tcp(os.getpid()) - before
        assert added == {("127.0.0.1", port)}
    finally:
        engine.close()


def test_strangers_are_rejected_logged_and_harmless(caplog: pytest.LogCaptureFixture) -> None:
    node = default_node_id()
    sender = ShmCheckpointEngine(bucket_bytes=1 << 16, timeout=20,
                                 context=WorkerContext(role="actor", rank=0, node_id=node))
    receiver = ShmCheckpointEngine(bucket_bytes=1 << 16, timeout=20,
                                   context=WorkerContext(role="rollout", rank=0, node_id=node))
    from weightsync.api.types import WorldMetadata

    metadata = WorldMetadata(actor=[sender.prepare()], rollout=[receiver.prepare()])
    topology = ShmCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=metadata)
    address = "\0" + str(topology.rollout[0]["address"])
    epoch = str(topology.rollout[0]["epoch"])
    forged_header = codec.encode(codec.BucketHeader(wire=codec.WIRE_VERSION, epoch=epoch, version=1, sender=0,
                                                    index=0, slot=0, nbytes=0, tensors=[]))
    wrong_epoch = codec.encode(codec.Hello(wire=codec.WIRE_VERSION, epoch="f" * 32, rank=0))
    payloads = [
        b"GET / HTTP/1.1\r\n\r\n",                                   # garbage
        len(forged_header).to_bytes(4, "little") + forged_header,    # a bucket header where a hello belongs
        len(wrong_epoch).to_bytes(4, "little") + wrong_epoch,        # a hello for another epoch
        (1 << 31).to_bytes(4, "little"),                             # an absurd frame length
        b"",                                                         # silence
    ]
    strangers = []
    for payload in payloads:
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect(address)
        if payload:
            stranger.sendall(payload)
        strangers.append(stranger)
    try:
        with caplog.at_level(logging.WARNING), concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            accepting = pool.submit(sender.init_process_group, rank_args=topology.actor[0])
            time.sleep(0.2)  # the strangers are queued first
            joining = pool.submit(receiver.init_process_group, rank_args=topology.rollout[0])
            accepting.result()
            joining.result()
        assert time.monotonic() - started < 8  # the silent stranger did not hold the real receiver up for long
        rejected = [record.getMessage() for record in caplog.records if "rejected a connection" in record.getMessage()]
        assert len(rejected) >= 4, rejected

        async def update() -> list[str]:
            names: list[str] = []

            async def consume() -> None:
                async for name, tensor in receiver.receive_weights():
                    assert bool((tensor == torch.full((100,), float(name[1:]))).all())
                    names.append(name)

            await asyncio.gather(sender.send_weights(good()), consume())
            return names

        assert asyncio.run(update()) == ["w0", "w1", "w2"]
    finally:
        for stranger in strangers:
            stranger.close()
        sender.close()
        receiver.close()


def test_epoch_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[bytes] = []
    original = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append(a)
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    hello = codec.encode(codec.Hello(wire=codec.WIRE_VERSION, epoch="a" * 32, rank=0))
    codec.decode_hello(hello, epoch="a" * 32)
    assert compared == [b"a" * 32]
