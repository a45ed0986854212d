"""A Ray cluster across a running testbed: the head on one host, a raylet on every host.

Each raylet runs inside its host (``Testbed.popen``), advertises the host's address, and offers one custom resource
named after the host (``testbed_host_resource(i)``), so every Ray process of host i — raylet, object store, workers —
lives in that host's namespaces: its object store is the host's own ``/dev/shm``, and everything it says to another
host crosses the links. The driver cannot live on the machine itself (the switch is not reachable from outside the
testbed, by design): ``driver()`` starts it inside a host, with ``RAY_ADDRESS`` set.

Ray's files (sessions, logs, sockets) go under the testbed's run folder, away from any other Ray cluster on the
machine, and go with it. Two settings differ from Ray's defaults, for every process of the cluster:
- ``RAY_AUTH_MODE=disabled``: ``ray start`` would otherwise create a token that a driver started later must find;
  the cluster is reachable only from inside the testbed anyway.
- the GCS's health check tolerates a link that is down for up to ``link_down_tolerance_s`` (default 60 s): a fault
  test takes a host's link down for a few seconds and expects the host back, not a node Ray declared dead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, Any

from typing_extensions import Self

from weightsync.testbed.bed import Testbed
from weightsync.testbed.cleanup import run_folder
from weightsync.testbed.processes import HostProcess
from weightsync.testbed.system import TestbedError

__all__ = ["TestbedRay", "testbed_host_resource"]

HEAD_PORT = 6379
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
HEALTH_CHECK_PERIOD_MS = 1000

# Run in the head's host: wait until every host's raylet has joined; print "nodes: {address: node id}" (ray.init
# may print to stdout too).
_WAIT_FOR_NODES = """
import json, sys, time
import ray
expected, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
ray.init(logging_level="ERROR")
while True:
    alive = [node for node in ray.nodes() if node["Alive"]]
    if len(alive) >= expected or time.monotonic() > deadline:
        break
    time.sleep(0.2)
print("nodes:", json.dumps({node["NodeManagerAddress"]: node["NodeID"] for node in alive}))
"""

# Run in the head's host: wait until the GCS accepts connections.
_WAIT_FOR_PORT = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.1)
"""


def testbed_host_resource(host: int) -> str:
    """The custom Ray resource only host ``host``'s raylet offers: ``resources={name: 1}`` places an actor there."""
    return f"testbed_host_{host}"


class TestbedRay:
    """Ray across ``testbed``'s hosts; a context manager (or ``start()`` / ``close()``) inside the testbed's lifetime.

    ``node_ids[i]`` is host i's Ray node id once started. ``num_cpus`` per raylet; ``env`` adds variables to every
    Ray process (and to drivers).
    """

    __test__ = False

    def __init__(self, testbed: Testbed, *, head: int = 0, num_cpus: int = 4, link_down_tolerance_s: float = 60.0,
                 env: Mapping[str, str] | None = None) -> None:
        if not testbed.started:
            raise TestbedError("TestbedRay needs a started testbed")
        self.bed = testbed
        self.head = testbed.hosts[head].index
        self.num_cpus = num_cpus
        self.address = f"{testbed.hosts[head].address}:{HEAD_PORT}"
        self.temp_dir = os.path.join(run_folder(testbed.run_name), "ray")
        failures = max(3, int(link_down_tolerance_s * 1000 / HEALTH_CHECK_PERIOD_MS))
        self.env = {
            **os.environ, **(env or {}),
            "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_health_check_period_ms": str(HEALTH_CHECK_PERIOD_MS),
            "RAY_health_check_failure_threshold": str(failures),
        }
        self.node_ids: tuple[str, ...] = ()
        self._raylets: list[HostProcess] = []
        self._log: IO[bytes] | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> Self:
        """Start the head, then a raylet in every other host; return once all have joined (TestbedError if not)."""
        os.makedirs(self.temp_dir, exist_ok=True)
        self._log = open(os.path.join(self.temp_dir, "raylets.log"), "ab")
        try:
            self._raylets.append(self._ray_start(self.head, ["--head", f"--port={HEAD_PORT}",
                                                             "--include-dashboard=false"]))
            self._wait_for_head()  # the others join a GCS that already listens
            for host in self.bed.hosts:
                if host.index != self.head:
                    self._raylets.append(self._ray_start(host.index, [f"--address={self.address}"]))
            self.node_ids = self._wait_for_nodes()
        except BaseException:
            self.close()
            raise
        return self

    def _ray_start(self, host: int, role: Sequence[str]) -> HostProcess:
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *role,
                f"--node-ip-address={self.bed.hosts[host].address}", f"--num-cpus={self.num_cpus}",
                f"--resources={json.dumps({testbed_host_resource(host): 1000})}",
                # A folder per host: raylets sharing one session folder pick socket names by looking for a free
                # one, and two starting at once pick the same (the second dies on "address already in use").
                f"--temp-dir={self.temp_dir}/h{host}", "--disable-usage-stats"]
        return self.bed.popen(host, argv, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log,
                              stderr=self._log)

    def _wait_for_head(self) -> None:
        host, port = self.address.rsplit(":", 1)
        done = self.bed.run(self.head, [sys.executable, "-c", _WAIT_FOR_PORT, host, port, str(START_TIMEOUT_S)],
                            timeout=START_TIMEOUT_S + 30, check=False)
        if done.returncode != 0:
            raise TestbedError(f"Ray's head did not listen on {self.address} within {START_TIMEOUT_S:g} s; "
                               f"it said: {self._log_tail()}")

    def _wait_for_nodes(self) -> tuple[str, ...]:
        started = time.monotonic()
        done = self.bed.run(self.head, [sys.executable, "-c", _WAIT_FOR_NODES, str(len(self.bed.hosts)),
                                        str(START_TIMEOUT_S)],
                            env=self.driver_env(), timeout=START_TIMEOUT_S + 30, check=False)
        if done.returncode != 0:
            raise TestbedError(f"Ray did not start on the testbed: {done.stderr.decode(errors='replace')[-2000:]}; "
                               f"the raylets said: {self._log_tail()}")
        lines = [line for line in done.stdout.decode().splitlines() if line.startswith("nodes: ")]
        by_address: dict[str, str] = json.loads(lines[-1].removeprefix("nodes: ")) if lines else {}
        missing = [host.index for host in self.bed.hosts if host.address not in by_address]
        if missing:
            raise TestbedError(f"hosts {missing} joined no Ray cluster within {time.monotonic() - started:.0f} s; "
                               f"the raylets said: {self._log_tail()}")
        return tuple(by_address[host.address] for host in self.bed.hosts)

    def _log_tail(self, nbytes: int = 3000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - nbytes))
            return log.read().decode(errors="replace")

    def driver_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a driver process: the cluster's settings plus ``RAY_ADDRESS``."""
        return {**self.env, **(extra or {}), "RAY_ADDRESS": self.address}

    def driver(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **popen: Any) -> HostProcess:
        """Start a driver program in the head's host (``ray.init()`` there joins this cluster)."""
        if not self.node_ids:
            raise TestbedError("TestbedRay.driver before start()")
        return self.bed.popen(self.head, argv, env=self.driver_env(env), **popen)

    def close(self) -> None:
        """Stop every raylet (SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``); idempotent. Raylets first, head last."""
        for process in reversed(self._raylets):
            process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in reversed(self._raylets):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)
        self._raylets.clear()
        self.node_ids = ()
        if self._log is not None:
            self._log.close()
            self._log = None
