"""The process side of ``weightsync bench``: one spawned process per rank, driven over a pipe with JSON commands.

A worker is one of three kinds:
- ``engine``: a registered backend's engine, built through the registry exactly as a deployment builds it;
- ``naive``: a plain gloo process group, one broadcast per tensor straight into the receivers' own tensors;
- ``bucketed``: the same group, verl's NCCL design on CPU — rank 0 packs bucket k+1 while the asynchronous broadcast
  of bucket k is in flight, receivers post the broadcast of bucket k+1 before unpacking bucket k (two buffers each).
The ``bucketed`` workers also serve the two yardsticks once their own figures are taken: a raw gloo broadcast of the
model's bytes between pre-faulted buffers, and the copy bandwidth of this host (see ``copy``).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import multiprocessing.connection
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from weightsync.api.registry import load_engine_class
from weightsync.api.types import WorkerContext
from weightsync.core.planner import PIECE_BYTES
from weightsync.core.tensors import copy_stream

__all__ = ["Layout", "bucket_plan", "c10d", "serve"]

# torch.distributed re-exports its C++ classes without declaring them to type checkers.
c10d: Any = dist

Layout = list[tuple[str, tuple[int, ...]]]
# One bucket: (tensor index, byte offset in the tensor, bytes, byte offset in the bucket) per piece.
Bucket = list[tuple[int, int, int, int]]

PAGE = resource.getpagesize()


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[Bucket]:
    """Fill buckets in model order; a tensor that does not fit is split across as many buckets as it needs."""
    buckets: list[Bucket] = [[]]
    used = 0
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            if used == bucket_bytes:
                buckets.append([])
                used = 0
            piece = min(size - offset, bucket_bytes - used)
            buckets[-1].append((index, offset, piece, used))
            offset += piece
            used += piece
    return [bucket for bucket in buckets if bucket]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so setup transients do not count; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _peak_bytes(reset_worked: bool) -> int:
    if reset_worked:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _Gloo:
    """The two baselines: a plain ProcessGroupGloo over the driver's TCPStore, on the loopback interface."""

    def __init__(self, spec: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self.kind: str = spec["kind"]
        self.rank: int = spec["group_rank"]
        store = c10d.TCPStore(spec["store_host"], spec["store_port"], is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        options = c10d.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=120)
        options._devices = [c10d.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.group = c10d.ProcessGroupGloo(c10d.PrefixStore(f"bench/{spec['tag']}", store), self.rank,
                                           spec["group_size"], options)
        self.tensors = tensors
        # Byte views of every tensor: a bucket piece is a slice of one of these.
        self.flat = [tensor.view(-1).view(torch.uint8) for tensor in tensors]
        self.plan = bucket_plan([view.numel() for view in self.flat], spec["bucket_bytes"])
        self.buffers: list[torch.Tensor] = []
        if self.kind == "bucketed":
            # Pre-faulted and reused across updates, like verl's double buffer.
            self.buffers = [torch.ones(spec["bucket_bytes"], dtype=torch.uint8) for _ in range(2)]

    def _broadcast(self, tensor: torch.Tensor) -> Any:
        options = c10d.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        return self.group.broadcast([tensor], options)

    def update(self) -> None:
        if self.kind == "naive":
            for tensor in self.tensors:
                self._broadcast(tensor).wait()
        elif self.rank == 0:
            self._send_bucketed()
        else:
            self._receive_bucketed()

    def _bucket_bytes(self, bucket: Bucket) -> int:
        return bucket[-1][3] + bucket[-1][2]

    def _send_bucketed(self) -> None:
        in_flight: list[Any] = [None, None]
        for index, bucket in enumerate(self.plan):
            slot = index % 2
            if in_flight[slot] is not None:
                in_flight[slot].wait()  # the broadcast of bucket k-2 still reads this buffer
            buffer = self.buffers[slot]
            for tensor_index, offset, size, at in bucket:
                buffer[at:at + size].copy_(self.flat[tensor_index][offset:offset + size])
            in_flight[slot] = self._broadcast(buffer[:self._bucket_bytes(bucket)])
        for work in in_flight:
            if work is not None:
                work.wait()

    def _receive_bucketed(self) -> None:
        plan = self.plan
        pending = self._broadcast(self.buffers[0][:self._bucket_bytes(plan[0])])
        for index, bucket in enumerate(plan):
            pending.wait()
            if index + 1 < len(plan):
                # Post the next bucket's receive before unpacking this one, so gloo fills the other buffer meanwhile.
                pending = self._broadcast(self.buffers[(index + 1) % 2][:self._bucket_bytes(plan[index + 1])])
            buffer = self.buffers[index % 2]
            for tensor_index, offset, size, at in bucket:
                self.flat[tensor_index][offset:offset + size].copy_(buffer[at:at + size])

    def close(self) -> None:
        for method in ("shutdown", "abort"):
            function = getattr(self.group, method, None)
            if function is not None:
                try:
                    function()
                except RuntimeError:
                    pass
                return


class _Worker:
    """One rank's state between the driver's commands: its model, its engine or gloo group, and the yardsticks'
    buffers."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        layout: Layout = [(name, tuple(shape)) for name, shape in spec["layout"]]
        # torch.ones touches every page: the receivers' model copies are pre-faulted, as an inference engine's are.
        self.tensors = [torch.ones(shape, dtype=torch.bfloat16) for _, shape in layout]
        self.by_name = dict(zip((name for name, _ in layout), self.tensors))
        self.engine: Any = None
        self.gloo: _Gloo | None = None
        if spec["kind"] == "engine":
            self.engine = load_engine_class(spec["backend"])(
                bucket_bytes=spec["bucket_bytes"],
                context=WorkerContext(role=spec["role"], rank=spec["rank"], node_id=spec["node_id"]),
            )
        self.rss_before = 0
        self.reset_worked = False
        self.raw: torch.Tensor | None = None
        self.copy_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def handle(self, command: dict[str, Any]) -> Any:
        """Carry out one command other than ``close``; the reply (None when there is nothing to say)."""
        op = command["op"]
        if op == "prepare":
            return self.engine.prepare()
        if op == "init":
            if self.engine is not None:
                self.engine.init_process_group(rank_args=command["rank_args"])
            else:
                self.gloo = _Gloo(self.spec, self.tensors)
        elif op == "mark":
            # Before the first update: what the process holds once its model and connections exist.
            self.rss_before = _rss_bytes()
            self.reset_worked = _reset_peak()
        elif op == "run":
            self.update()
        elif op == "rss":
            return max(0, _peak_bytes(self.reset_worked) - self.rss_before)
        elif op == "trace":
            return self.traced_update()
        elif op == "raw_setup":
            self.raw = torch.ones(command["nbytes"], dtype=torch.uint8)  # pre-faulted
        elif op == "raw":
            if self.gloo is None or self.raw is None:
                raise RuntimeError("raw before init/raw_setup")
            self.gloo._broadcast(self.raw).wait()
        elif op == "copy_setup":
            self.raw = None
            self.copy_buffers = (torch.ones(command["nbytes"], dtype=torch.uint8),
                                 torch.zeros(command["nbytes"], dtype=torch.uint8))
            self.copy_buffers[1].fill_(1)  # pre-fault the destination too
        elif op == "copy":
            return self.copy(command["times"], command.get("method", "tensor"))
        return None

    def update(self) -> None:
        if self.engine is not None:
            if self.spec["role"] == "actor":
                asyncio.run(self.engine.send_weights(zip(self.by_name.keys(), self.tensors)))
            else:
                asyncio.run(self._receive())
            self.engine.finalize()
        elif self.gloo is not None:
            self.gloo.update()

    async def _receive(self) -> None:
        # The receiver's model exists already: the stream copies straight into it (``ReceivedWeights.copy_into``).
        await self.engine.receive_weights().copy_into(self.by_name)

    def traced_update(self) -> list[Any]:
        engine = self.engine
        events = engine.enable_tracing() if engine is not None and hasattr(engine, "enable_tracing") else None
        self.update()
        reply = list(events or [])
        engine.trace_events = None
        return reply

    def copy(self, times: int, method: str) -> list[float]:
        """Copy the copy buffer ``times`` times; the span [start, end] on this host's monotonic clock."""
        if self.copy_buffers is None:
            raise RuntimeError("copy before copy_setup")
        source, destination = self.copy_buffers
        started = time.perf_counter()
        if method == "engine":
            # What the engines do with large tensors: ``copy_stream`` in the pieces the digest follows (see
            # weightsync.core.engine).
            to, frm, nbytes = destination.data_ptr(), source.data_ptr(), source.numel()
            for _ in range(times):
                for offset in range(0, nbytes, PIECE_BYTES):
                    copy_stream(to + offset, frm + offset, min(PIECE_BYTES, nbytes - offset))
        else:
            for _ in range(times):
                destination.copy_(source)
        return [started, time.perf_counter()]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.gloo is not None:
            self.gloo.close()


def serve(conn: multiprocessing.connection.Connection, spec: dict[str, Any]) -> None:
    """Answer the driver's commands until ``close``; every reply is JSON (``null`` when there is nothing to say)."""
    # One intra-op thread: R+1 processes already share the cores, and torch's own threads would fight over them.
    torch.set_num_threads(1)
    worker = _Worker(spec)
    while True:
        command = json.loads(conn.recv_bytes())
        if command["op"] == "close":
            worker.close()
            conn.send_bytes(b"null")
            return
        conn.send_bytes(json.dumps(worker.handle(command)).encode())
