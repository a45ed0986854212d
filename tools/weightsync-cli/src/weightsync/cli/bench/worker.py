"""The process side of ``weightsync bench``: one spawned process per rank, driven over a pipe with JSON commands.

A worker is one of three kinds:
- ``engine``: an ``EngineHost`` (what an adapter keeps in every worker process: ``weightsync.core.worker.host``),
  driven by the driver's ``CheckpointEngineManager`` through the worker group and replicas of
  ``weightsync.cli.bench.group``: the engine is built from the manager's spec at ``prepare``, exactly as a
  deployment builds it (with ``--sharded`` an actor rank holds FSDP2 shards of the model instead of the whole:
  ``weightsync.cli.bench.sharded``);
- ``naive``: a plain gloo process group, one broadcast per tensor straight into the receivers' own tensors;
- ``bucketed``: the same group, verl's NCCL design on CPU — rank 0 packs bucket k+1 while the asynchronous broadcast
  of bucket k is in flight, receivers post the broadcast of bucket k+1 before unpacking bucket k (two buffers each).
The ``bucketed`` workers also serve the two yardsticks once their own figures are taken: a raw gloo broadcast of the
model's bytes between pre-faulted buffers, and the copy bandwidth of this host (see ``copy``).

On this machine a worker is a ``multiprocessing`` child (of a fork server that imported this module once) talking
over a ``Pipe`` (``serve``); on a testbed host (``bench --hosts``) it is forked in the host by that host's fork server
(``weightsync.cli.bench.forks``), talking over a socket with the same framing, and it takes its node id and address
from the host's ``WEIGHTSYNC_TESTBED_*`` variables.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import resource
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
from weightsync.api.parts import Part
from weightsync.api.sources import SourceLayout
from weightsync.api.types import StagedUpdate
from weightsync.cli.bench.rl import load_version
from weightsync.cli.bench.serving import Server
from weightsync.cli.bench.sharded import FsdpModel, mismatches
from weightsync.core.native import copy_stream
from weightsync.core.transports.place import LOCAL_RANK_ENV
from weightsync.core.wire.layout import PIECE_BYTES
from weightsync.core.worker.host import EngineHost

__all__ = ["Channel", "Layout", "bucket_plan", "c10d", "serve", "worker_identity"]

# torch.distributed re-exports its C++ classes without declaring them to type checkers.
c10d: Any = dist

Layout = list[tuple[str, tuple[int, ...]]]
# One bucket: (tensor index, byte offset in the tensor, bytes, byte offset in the bucket) per piece.
Bucket = list[tuple[int, int, int, int]]

_ENGINE_OPS = frozenset({"execute", "send", "receive", "stage", "apply_staged", "trace_on", "trace_off"})

PAGE = resource.getpagesize()
STORE_TIMEOUT = datetime.timedelta(seconds=120)


class Channel(Protocol):
    """One end of a worker's command channel: length-framed messages both ways."""

    def send_bytes(self, buf: bytes) -> None: ...

    def recv_bytes(self) -> bytes: ...


def worker_identity(spec: dict[str, Any]) -> tuple[str, str]:
    """This worker's node id and the address peers reach it at: on a testbed host the host's own (its environment
    says which host it runs in), else what the driver put in ``spec``. Sets ``LOCAL_RANK`` to the worker's rank
    among its host's workers (``spec["local_rank"]``), from which it takes its rail (``local_rail``)."""
    os.environ[LOCAL_RANK_ENV] = str(spec.get("local_rank", 0))
    if not spec.get("testbed"):
        return spec["node_id"], spec.get("host_ip", "127.0.0.1")
    from weightsync.testbed import ENV_ADDR, ENV_NODE_ID  # an extra of the CLI, there on a testbed host

    node_id, address = os.environ.get(ENV_NODE_ID), os.environ.get(ENV_ADDR)
    if not node_id or not address:
        raise RuntimeError(f"a testbed worker runs outside a testbed host ({ENV_NODE_ID}/{ENV_ADDR} are not set)")
    return node_id, address


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
    """The two baselines: a plain ProcessGroupGloo over a TCPStore, on this worker's address (the loopback interface
    on this machine, the host's link on a testbed). The store is the driver's on this machine, group rank 0's
    (``store``) on a testbed, where the driver cannot be reached."""

    def __init__(self, spec: dict[str, Any], tensors: list[torch.Tensor], *, host_ip: str, store_host: str,
                 store_port: int, store: Any = None) -> None:
        self.kind: str = spec["kind"]
        self.rank: int = spec["group_rank"]
        if store is None:
            store = c10d.TCPStore(store_host, store_port, is_master=False, timeout=STORE_TIMEOUT)
        options = c10d.ProcessGroupGloo._Options()
        options._timeout = STORE_TIMEOUT
        options._devices = [c10d.ProcessGroupGloo.create_device(hostname=host_ip)]
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


class _Sink:
    """The receiver's model: the stream copies straight into its tensors (``ReceivedWeights.copy_into``)."""

    def __init__(self, destinations: dict[str, torch.Tensor]) -> None:
        self.destinations = destinations

    async def load_weights(self, weights: Any, *, version: int) -> None:
        await weights.copy_into(self.destinations)


def _held_shape(part: Part | None, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """What a receiver holding ``part`` keeps of tensor ``name``: its shape, or its one box's."""
    regions = part.regions(name) if part is not None else None
    if regions is None:
        return shape
    if len(regions) != 1:
        raise ValueError(f"a bench part holds one box of a tensor, {name!r} has {len(regions)}")
    return regions[0].size


class _Worker:
    """One rank's state between the driver's commands: its model, its engine's host or gloo group, and the
    yardsticks' buffers."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        layout: Layout = [(name, tuple(shape)) for name, shape in spec["layout"]]
        part = Part.from_dict(spec["part"]) if spec.get("part") is not None else None
        # ``--sharded``: an actor rank holds its FSDP2 shards only. Joining its group blocks until every rank has: at
        # once over the driver's store, at ``join`` on a testbed (where actor rank 0 hosts the store: ``store``).
        self.layout = layout
        self.sharded_actor = spec["role"] == "actor" and bool(spec.get("source"))
        self.fsdp = FsdpModel(spec, layout) if self.sharded_actor and "store_port" in spec else None
        # torch.ones touches every page: the receivers' model copies are pre-faulted, as an inference engine's are.
        # A receiver that holds a part (``--parts``) holds only it: a shard of each box, whole tensors, nothing else.
        self.by_name = {name: torch.ones(_held_shape(part, name, shape), dtype=torch.bfloat16) for name, shape in layout
                        if (part is None or part.regions(name) != ()) and not self.sharded_actor}
        self.tensors = list(self.by_name.values())
        self.gloo: _Gloo | None = None
        self.store: Any = None
        self.node_id, self.host_ip = worker_identity(spec)
        source = self.held if self.sharded_actor and spec["source"] == "sharded" else None  # declared: +sharded
        self.host = EngineHost(node_id=self.node_id, host_ip=self.host_ip, name=f"{spec['role']} {spec['rank']}",
                               part=part, source=source) if spec["kind"] == "engine" else None
        self.sink = _Sink(self.by_name)
        self.server: Server | None = None
        """``--staged``: this receiver's serving loop."""
        self.rss_before = 0
        self.reset_worked = False
        self.raw: torch.Tensor | None = None
        self.copy_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def held(self) -> SourceLayout:
        """What a ``+sharded`` actor rank holds (``EngineHost(source=...)``, asked at every ``prepare``)."""
        if self.fsdp is None:
            raise RuntimeError("a sharded actor rank was asked what it holds before it joined its group")
        return self.fsdp.layout()

    def handle(self, command: dict[str, Any]) -> Any:
        """Carry out one command other than ``close``; the reply (None when there is nothing to say)."""
        op = command["op"]
        if op == "store":
            self.store = c10d.TCPStore(self.host_ip, 0, None, True, wait_for_workers=False, timeout=STORE_TIMEOUT)
            return {"store_host": self.host_ip, "store_port": int(self.store.port)}
        if op == "join":  # ``--sharded`` on a testbed: the FSDP2 group, over actor rank 0's store (in the command)
            self.fsdp = FsdpModel({**self.spec, **command}, self.layout)
        elif op == "init":
            # The baselines' group. The store's address: in the command on a testbed (group rank 0's), in the
            # spec on this machine.
            where: dict[str, Any] = {key: command.get(key, self.spec.get(key)) for key in ("store_host", "store_port")}
            self.gloo = _Gloo(self.spec, self.tensors, host_ip=self.host_ip, store_host=where["store_host"],
                              store_port=where["store_port"], store=self.store)
        elif op == "load":
            # ``--mix rl``: the sender takes on the next version before an update (untimed); receivers keep theirs.
            if self.spec.get("versions") and self.spec["role"] == "actor":
                load_version(self.spec["versions"], command["version"], self.tensors)
            elif self.fsdp is not None:  # ``--sharded``: each version differs, so a receiver's check means something
                self.fsdp.fill(command["version"])
        elif op == "check":  # ``--sharded``: what a receiver holds against the version sent
            return mismatches(self.by_name, command["version"])
        elif op == "mark":
            # Before the first update: what the process holds once its model and connections exist.
            self.rss_before = _rss_bytes()
            self.reset_worked = _reset_peak()
        elif op == "run":
            if self.gloo is not None:
                self.gloo.update()
        elif op == "rss":
            return max(0, _peak_bytes(self.reset_worked) - self.rss_before)
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
        elif op in _ENGINE_OPS:
            return self.engine_op(op, command)
        else:
            return self.serving(op, command)
        return None

    def engine_op(self, op: str, command: dict[str, Any]) -> Any:
        """What the manager asks of this worker's engine host (``weightsync.cli.bench.group``): a lifecycle step,
        an update's send or receive, a staged update's stage or swap, and tracing; reports as plain data."""
        host = self.host
        if host is None:
            raise RuntimeError(f"{op} on a {self.spec['kind']} worker")
        if op == "execute":
            return asyncio.run(host.execute(command["method"], **command.get("kwargs", {})))
        if op == "send":
            weights = self.fsdp.weights() if self.fsdp is not None else zip(self.by_name.keys(), self.tensors)
            return asyncio.run(host.send(weights, version=command["version"])).to_dict()
        if op == "receive":
            return asyncio.run(host.receive(self.sink, version=command["version"])).to_dict()
        if op == "stage":
            return asyncio.run(host.stage(version=command["version"])).to_dict()
        if op == "apply_staged":
            staged = StagedUpdate.from_dict(command["staged"])
            return asyncio.run(host.apply_staged(self.sink, staged=staged)).to_dict()
        engine: Any = host.engine
        if op == "trace_on":
            engine.enable_tracing()
            return None
        events = list(engine.trace_events or [])  # trace_off
        engine.trace_events = None
        return events

    def serving(self, op: str, command: dict[str, Any]) -> Any:
        """``--staged``'s commands (``weightsync.cli.bench.serving``): the receivers serve while not paused."""
        if op == "serve":
            self.server = Server(self.tensors)
            return None
        server = self.server
        if server is None:
            raise RuntimeError(f"{op} before serve")
        if op == "pause":
            return server.pause()
        if op == "resume":
            return server.resume()
        if op == "first_after":
            return server.first_after(command["mark"])
        if op == "count":
            return server.count(command["start"], command["end"])
        if op == "failed":
            return server.failed
        raise RuntimeError(f"unknown bench command {op!r}")

    def copy(self, times: int, method: str) -> list[float]:
        """Copy the copy buffer ``times`` times; the span [start, end] on this host's monotonic clock."""
        if self.copy_buffers is None:
            raise RuntimeError("copy before copy_setup")
        source, destination = self.copy_buffers
        started = time.perf_counter()
        if method == "engine":
            # What the engines do with large tensors: ``copy_stream`` in the pieces the digest follows (see
            # weightsync.core.worker.engine).
            to, frm, nbytes = destination.data_ptr(), source.data_ptr(), source.numel()
            for _ in range(times):
                for offset in range(0, nbytes, PIECE_BYTES):
                    copy_stream(to + offset, frm + offset, min(PIECE_BYTES, nbytes - offset))
        else:
            for _ in range(times):
                destination.copy_(source)
        return [started, time.perf_counter()]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.host is not None:
            asyncio.run(self.host.execute("close"))
        if self.gloo is not None:
            self.gloo.close()
        if self.fsdp is not None:
            self.fsdp.close()


def serve(conn: Channel, spec: dict[str, Any]) -> None:
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
