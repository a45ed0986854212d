"""Tiny network programs the testbed tests run inside hosts (by file path: ``python netprobe.py MODE ...``).

- ``sink ADDR PORT SECONDS``: accept connections for SECONDS, read each to EOF; per connection one JSON line
  ``{"bytes": n, "seconds": first byte to EOF}``.
- ``send ADDR PORT BYTES``: connect, send BYTES, close; prints ``{"bytes": n}``.
- ``stream ADDR PORT SECONDS``: connect, send until a send makes no progress for 1 s (prints
  ``{"stalled": true, "bytes": n}``) or SECONDS pass (``{"stalled": false, ...}``); prints ``streaming`` first,
  once 8 MiB went out.
- ``connect ADDR PORT TIMEOUT``: exit 0 if a TCP connection opens within TIMEOUT seconds, else 3.

Everything is bounded in time; nothing here imports more than the standard library.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

CHUNK = 1 << 20


def sink(address: str, port: int, seconds: float) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, port))
    server.listen(16)
    server.settimeout(0.2)
    print("listening", flush=True)
    deadline = time.monotonic() + seconds
    lock = threading.Lock()

    def drain(connection: socket.socket) -> None:
        connection.settimeout(max(0.1, deadline - time.monotonic()))
        buffer = bytearray(CHUNK)
        total, first = 0, 0.0
        try:
            while True:
                received = connection.recv_into(buffer)
                if not received:
                    break
                if total == 0:
                    first = time.perf_counter()
                total += received
        except OSError:
            pass
        finally:
            connection.close()
        with lock:
            print(json.dumps({"bytes": total, "seconds": time.perf_counter() - first if total else 0.0}), flush=True)

    while time.monotonic() < deadline:
        try:
            connection, _ = server.accept()
        except TimeoutError:
            continue
        threading.Thread(target=drain, args=(connection,), daemon=True).start()


def send(address: str, port: int, count: int) -> None:
    payload = memoryview(bytes(CHUNK))
    with socket.create_connection((address, port), timeout=30) as connection:
        sent = 0
        while sent < count:
            piece = payload[: min(CHUNK, count - sent)]
            connection.sendall(piece)
            sent += len(piece)
    print(json.dumps({"bytes": sent}), flush=True)


def stream(address: str, port: int, seconds: float) -> None:
    payload = memoryview(bytes(CHUNK))
    deadline = time.monotonic() + seconds
    sent, announced = 0, False
    with socket.create_connection((address, port), timeout=10) as connection:
        connection.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                sent += connection.send(payload)
            except TimeoutError:
                print(json.dumps({"stalled": True, "bytes": sent}), flush=True)
                return
            if not announced and sent >= 8 * CHUNK:
                print("streaming", flush=True)
                announced = True
    print(json.dumps({"stalled": False, "bytes": sent}), flush=True)


def connect(address: str, port: int, timeout: float) -> int:
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except OSError:
        return 3
    return 0


def main(argv: list[str]) -> int:
    mode, address, port, value = argv[0], argv[1], int(argv[2]), argv[3]
    if mode == "sink":
        sink(address, port, float(value))
    elif mode == "send":
        send(address, port, int(value))
    elif mode == "stream":
        stream(address, port, float(value))
    elif mode == "connect":
        return connect(address, port, float(value))
    else:
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
