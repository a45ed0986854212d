"""Run one engine per process — a sender and N receivers — and drive the lifecycle from this process.

Worker processes are forked from ``multiprocessing``'s fork server (a clean interpreter that has imported torch and
nothing of the driver's, as a real worker is; forked, not spawned, because a spawned worker spends seconds importing
torch and the kit starts three per case), take the driver's environment as it is when they start, and are driven over
a pipe with JSON commands. Every receiver checks what it got against its own copy of the case, by raw bytes, inside the
``async for`` loop — so the check also holds the engine to its view-validity contract.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback
from collections.abc import Sequence
from typing import Any

from weightsync.api.registry import load_engine_class
from weightsync.api.testing.cases import PLACEMENTS
from weightsync.api.topology import build_checked_topology, epoch_of, with_epoch
from weightsync.api.types import Role, Topology, WorkerContext, WorldMetadata

__all__ = ["ConformanceFailure", "EngineHarness", "WorkerFailed", "checked_options"]


class ConformanceFailure(AssertionError):
    """A receiver got something other than what was sent (names, dtypes, shapes or bytes)."""


class WorkerFailed(RuntimeError):
    """A worker raised; ``error_type`` is the class name of what it raised, ``text`` its message and traceback."""

    def __init__(self, worker: str, error_type: str, text: str) -> None:
        super().__init__(f"{worker} raised {error_type}: {text}")
        self.worker = worker
        self.error_type = error_type
        self.text = text
        self.others: list[WorkerFailed] = []
        """What the other workers of the same step raised (this one is the first in worker order)."""


def checked_options(backend: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``check_transport=True`` for an engine that checks the rules between its pipeline and its
    transport (weightsync's bucket engines: ``checks_transport_rules``), so every case of the kit also checks them."""
    if load_engine_class(backend).checks_transport_rules:
        return {"check_transport": True, **options}
    return dict(options)


def _node_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return f"{socket.gethostname()}/{handle.read().strip()}"
    except OSError:
        return socket.gethostname()


def _worker_main(conn: multiprocessing.connection.Connection, backend: str, role: Role, rank: int,
                 bucket_bytes: int, options: dict[str, Any], node_id: str, where: tuple[str, str],
                 environment: dict[str, str]) -> None:
    # The fork server's environment is the one it started with: the worker takes the driver's as it is now.
    os.environ.clear()
    os.environ.update(environment)
    import torch

    from weightsync.api.testing.cases import place, resolve_device

    torch.set_num_threads(1)
    engine: Any = None
    device, placement = where
    while True:
        command = json.loads(conn.recv_bytes())
        op = command["op"]
        try:
            if op == "start":
                device = resolve_device(device)  # registers an emulated device in this process, first
                engine_class = load_engine_class(backend)
                context = WorkerContext(role=role, rank=rank, node_id=node_id)
                engine = engine_class(bucket_bytes=bucket_bytes, context=context, **options)
                reply: Any = None
            elif op == "prepare":
                reply = engine.prepare()
            elif op == "init":
                engine.init_process_group(rank_args=command["rank_args"])
                reply = None
            elif op == "send":
                from weightsync.api.testing.cases import case_tensors

                weights = place(case_tensors(command["case"], command["update"], bucket_bytes), device, placement)
                report = asyncio.run(engine.send_weights(weights))
                reply = report.to_dict()
            elif op == "receive":
                reply = asyncio.run(_receive_and_check(engine, command["case"], command["update"], bucket_bytes,
                                                       command.get("mode", "iterate"), (device, placement)))
            elif op == "finalize":
                engine.finalize()
                reply = None
            elif op == "close":
                if engine is not None:
                    engine.close()
                conn.send_bytes(json.dumps({"ok": True, "reply": None}).encode())
                return
            else:
                raise ValueError(f"unknown harness command {op!r}")
            conn.send_bytes(json.dumps({"ok": True, "reply": reply}).encode())
        except BaseException as exc:  # reported to the driver, which decides
            conn.send_bytes(json.dumps({
                "ok": False, "type": type(exc).__name__, "text": f"{exc}\n{traceback.format_exc()}",
            }).encode())


RECEIVE_MODES = ("iterate", "copy_into", "wrong_shape", "in_place")
"""How a receiver consumes the stream: ``async for``; ``copy_into`` destinations (some non-contiguous, some names
left to the fallback); ``copy_into`` with one destination of the wrong shape (it must raise before writing); or
``in_place``: ``copy_into`` the same destinations every update of a case (one for every name, as a model's
parameters are; what a delta update changes in place)."""

_KEPT_DESTINATIONS: dict[str, dict[str, Any]] = {}
"""``in_place`` destinations, per case, in this worker process."""


async def _receive_and_check(engine: Any, case: str, update: int, bucket_bytes: int, mode: str,
                             where: tuple[str, str]) -> dict[str, Any]:
    from weightsync.api.testing.cases import case_tensors, raw_bytes

    expected = {name: tensor for name, tensor in case_tensors(case, update, bucket_bytes)}
    problems: list[str] = []
    seen: list[str] = []

    def check(name: str, tensor: Any) -> None:
        seen.append(name)
        want = expected.get(name)
        if want is None:
            problems.append(f"unexpected tensor {name!r}")
        elif tensor.dtype != want.dtype or tuple(tensor.shape) != tuple(want.shape):
            problems.append(f"{name}: got {tensor.dtype}{tuple(tensor.shape)}, sent {want.dtype}{tuple(want.shape)}")
        else:
            got, sent = raw_bytes(tensor), raw_bytes(want)
            if got.numel() != sent.numel() or not bool((got == sent).all()):
                problems.append(f"{name}: bytes differ")

    stream = engine.receive_weights()
    if mode == "iterate":
        async for name, tensor in stream:
            check(name, tensor)
    else:
        if mode == "in_place":
            if case not in _KEPT_DESTINATIONS:
                _KEPT_DESTINATIONS[case] = _destinations(expected, *where, every_name=True)
            destinations = _KEPT_DESTINATIONS[case]
        else:
            destinations = _destinations(expected, *where)
        if mode == "wrong_shape":
            return await _expect_destination_error(stream, expected, destinations)
        count = await stream.copy_into(destinations, fallback=check)
        for name, destination in destinations.items():
            check(name, destination.detach())
        if count != len(seen):
            problems.append(f"copy_into returned {count} for {len(seen)} tensors")
    missing = sorted(set(expected) - set(seen))
    if missing:
        problems.append(f"missing tensors: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if len(seen) != len(set(seen)):
        problems.append("a tensor was yielded twice")
    report = stream.report
    return {"problems": problems, "count": len(seen), "report": report.to_dict() if report is not None else None}


def _destinations(expected: dict[str, Any], device: str, placement: str, *, every_name: bool = False
                  ) -> dict[str, Any]:
    """Zeroed destinations for most tensors: every 5th matrix a non-contiguous one (``copy_`` fills it), every 4th
    floating-point tensor a ``Parameter`` that requires grad (a model's own), and every 7th name left out (the
    fallback gets its view) unless ``every_name``. On ``device``, all of them, or (``placement="mixed"``) two in
    three, a pattern that crosses the sources' alternation so that every pairing of host and device occurs."""
    import torch

    destinations: dict[str, Any] = {}
    for index, (name, tensor) in enumerate(expected.items()):
        at = device if placement == "device" or index % 3 != 1 else "cpu"
        if index % 7 == 3 and not every_name:
            continue
        if index % 5 == 1 and tensor.dim() == 2:
            destinations[name] = torch.zeros(tuple(reversed(tensor.shape)), dtype=tensor.dtype, device=at).t()
        elif index % 4 == 2 and tensor.dtype.is_floating_point:
            destinations[name] = torch.nn.Parameter(torch.zeros(tensor.shape, dtype=tensor.dtype, device=at))
        else:
            destinations[name] = torch.zeros(tensor.shape, dtype=tensor.dtype, device=at)
    return destinations


async def _expect_destination_error(
    stream: Any, expected: dict[str, Any], destinations: dict[str, Any]
) -> dict[str, Any]:
    import torch

    from weightsync.api.errors import DestinationError

    name = next(name for name, tensor in expected.items() if tensor.numel() > 1)
    wrong = torch.zeros(expected[name].numel() + 1, dtype=expected[name].dtype)
    destinations = {**destinations, name: wrong}
    problems: list[str] = []
    try:
        await stream.copy_into(destinations, fallback=lambda _name, _tensor: None)
        problems.append(f"copy_into accepted a {tuple(wrong.shape)} destination for {name!r}")
    except DestinationError as exc:
        if getattr(exc, "name", None) != name:
            problems.append(f"DestinationError names {getattr(exc, 'name', None)!r}, not {name!r}")
    if bool(wrong.any()):
        problems.append(f"the mismatched destination of {name!r} was written")
    return {"problems": problems, "count": 0, "report": None, "raised": "DestinationError"}


class EngineHarness:
    """A sender (actor rank 0 of an ``actor_wg`` of one) and ``receivers`` rollout workers, each its own process."""

    def __init__(self, backend: str, *, receivers: int = 2, bucket_bytes: int = 1 << 20,
                 options: dict[str, Any] | None = None, timeout: float = 120.0, device: str = "cpu",
                 placement: str = "device", hosts: Sequence[int] | None = None) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if hosts is not None and len(hosts) != receivers + 1:
            raise ValueError(f"hosts needs one entry per worker (the sender, then {receivers} receivers), got "
                             f"{len(hosts)}")
        self.hosts = list(hosts) if hosts is not None else None
        self.backend = backend
        self.device = device
        """``"cpu"``, a device type, or ``"module:function"`` registering a device in each worker (``resolve_device``)."""
        self.placement = placement
        self.receivers = receivers
        self.bucket_bytes = bucket_bytes
        self.options = dict(options or {})
        self.timeout = timeout
        self.engine_class = load_engine_class(backend)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["torch"])
        self._workers: list[tuple[str, multiprocessing.connection.Connection, Any]] = []
        self.epoch = ""

    def alike(self, **options: Any) -> EngineHarness:
        """A harness of its own (not started) for the same backend, workers and placement, with ``options`` added
        to the engines' options."""
        return EngineHarness(self.backend, receivers=self.receivers, bucket_bytes=self.bucket_bytes,
                             options={**self.options, **options}, timeout=self.timeout, device=self.device,
                             placement=self.placement, hosts=self.hosts)

    # -- processes -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        node = _node_id()
        roles: list[tuple[str, Role, int]] = [("actor rank 0", "actor", 0)]
        roles += [(f"rollout rank {rank}", "rollout", rank) for rank in range(self.receivers)]
        for index, (label, role, rank) in enumerate(roles):
            # A pretend host is a node id of its own on this machine.
            worker_node = node if self.hosts is None else f"{node}/host{self.hosts[index]}"
            parent, child = self._context.Pipe()
            process = self._context.Process(
                target=_worker_main,
                args=(child, self.backend, role, rank, self.bucket_bytes, self.options, worker_node,
                      (self.device, self.placement), dict(os.environ)),
                daemon=True, name=f"weightsync-conformance-{label}",
            )
            process.start()
            child.close()
            self._workers.append((label, parent, process))
        self._all("start")

    def close(self) -> None:
        for _, conn, _process in self._workers:
            try:
                conn.send_bytes(json.dumps({"op": "close"}).encode())
            except OSError:
                pass
        deadline = time.monotonic() + 20
        for _, conn, process in self._workers:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                process.kill()
                process.join(5)
            conn.close()
        self._workers = []

    def _send(self, index: int, command: dict[str, Any]) -> None:
        self._workers[index][1].send_bytes(json.dumps(command).encode())

    def _wait(self, index: int, deadline: float) -> Any:
        label, conn, process = self._workers[index]
        while not conn.poll(0.2):
            if not process.is_alive():
                raise WorkerFailed(label, "ProcessDied", f"exit code {process.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label} did not answer within {self.timeout}s")
        message = json.loads(conn.recv_bytes())
        if not message["ok"]:
            raise WorkerFailed(label, message["type"], message["text"])
        return message["reply"]

    def _all(self, op: str, per_worker: Sequence[dict[str, Any]] | None = None) -> list[Any]:
        return self._step([{"op": op, **(per_worker[index] if per_worker is not None else {})}
                           for index in range(len(self._workers))])

    def _step(self, commands: Sequence[dict[str, Any]]) -> list[Any]:
        """Send each worker its command, then wait for every reply; raise the first failure (the others with it)."""
        for index, command in enumerate(commands):
            self._send(index, command)
        deadline = time.monotonic() + self.timeout
        replies: list[Any] = []
        failures: list[BaseException] = []
        for index in range(len(self._workers)):
            try:
                replies.append(self._wait(index, deadline))
            except (WorkerFailed, TimeoutError) as exc:
                failures.append(exc)
                replies.append(None)
        if failures:
            first = failures[0]
            if isinstance(first, WorkerFailed):
                first.others = [each for each in failures[1:] if isinstance(each, WorkerFailed)]
            raise first
        return replies

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def setup(self) -> Topology:
        """prepare → build_topology → init_process_group, with a fresh epoch token."""
        metadata = self._all("prepare")
        topology = build_checked_topology(
            self.engine_class, backend=self.backend, actor_wg_world_size=1, rollout_world_size=self.receivers,
            metadata=WorldMetadata(actor=metadata[:1], rollout=metadata[1:]),
        )
        # Engines normally stamp the epoch token themselves; the kit supplies one for those that do not.
        topology = with_epoch(topology)
        self.epoch = epoch_of(topology.actor[0])
        self._all("init", [{"rank_args": args} for args in [*topology.actor, *topology.rollout]])
        return topology

    def update(self, case: str, update: int = 0, *, mode: str | Sequence[str] = "iterate") -> list[dict[str, Any]]:
        """One update of ``case``; returns each receiver's result. Raises ``WorkerFailed`` if any worker raised.

        ``mode`` is how the receivers consume it (``RECEIVE_MODES``; or one mode per receiver); with
        ``wrong_shape`` they must raise ``DestinationError`` without writing, and the sender must still finish.
        """
        modes = [mode] * self.receivers if isinstance(mode, str) else list(mode)
        if len(modes) != self.receivers or any(each not in RECEIVE_MODES for each in modes):
            raise ValueError(f"mode must be one of {RECEIVE_MODES}, or one of them per receiver, got {mode!r}")
        replies = self._step([{"op": "send", "case": case, "update": update},
                              *({"op": "receive", "case": case, "update": update, "mode": each} for each in modes)])
        self._all("finalize")
        sender = replies[0]
        results = replies[1:]
        for rank, result in enumerate(results):
            if result["problems"]:
                raise ConformanceFailure(f"{self.backend}, case {case}, rollout rank {rank}: "
                                         + "; ".join(result["problems"][:10]))
            if modes[rank] == "wrong_shape":
                continue
            if result["report"] is None or result["report"]["digest"] != sender["digest"]:
                raise ConformanceFailure(f"{self.backend}, case {case}, rollout rank {rank}: digest differs")
        return [sender, *results]

    @property
    def pids(self) -> list[int]:
        return [process.pid for _, _, process in self._workers]
