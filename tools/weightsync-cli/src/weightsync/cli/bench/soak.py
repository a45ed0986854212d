"""``weightsync bench --soak N``: N delta updates on the emulated testbed with replicas killed and added as they run.

A testbed of 4 hosts (links of 2 Gb/s) joined in one Ray cluster; the driver (``soak_driver``, run in the head host)
drives one manager over it and checks every update from outside the manager (its docstring). Here, around it: what
the run must not leave behind — the testbed's namespaces (``ip netns``), ring segments in ``/dev/shm`` (those a
killed worker left are swept as the product sweeps them, and counted), actors the cluster still says are alive. The
exit status is 0 only when every update and every leftover check passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

SOAK_HOSTS = 4
SOAK_LINK_GBPS = 2.0
LINE_TIMEOUT_S = 300.0
"""The longest the driver may stay silent: one update, the cluster's start, or its shutdown."""


@dataclass
class SoakResult:
    updates: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    swept: int = 0
    """Ring segments killed workers left, swept at the end."""

    @property
    def ok(self) -> bool:
        return bool(self.updates) and not self.problems


def segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("weightsync-")}


def namespaces(run: str) -> set[str]:
    """The network namespaces of testbed run ``run`` that exist (another run's, e.g. a test's, are not ours)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(run)}


def _line(process: subprocess.Popen[bytes]) -> dict[str, Any] | None:
    """The driver's next JSON line (None when it ended), within ``LINE_TIMEOUT_S``."""
    assert process.stdout is not None
    stdout, lines = process.stdout, []
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(LINE_TIMEOUT_S)
    if not lines:
        raise TimeoutError(f"the soak driver said nothing for {LINE_TIMEOUT_S:g} s")
    return json.loads(lines[0]) if lines[0].strip() else None


def soak(updates: int, seed: int, *, say: Any = print, max_evicted: int = 1) -> SoakResult:
    """Run the soak (module docstring); ``say`` gets one line per update (``max_evicted``: the manager's
    ``SyncConfig.max_evicted``; 0, eviction off, is the soak's negative control)."""
    from weightsync.core.transports.sharedmem import sweep_orphan_segments
    from weightsync.testbed import Testbed, TestbedRay

    result = SoakResult()
    before_shm = segments()
    with Testbed(SOAK_HOSTS, link_gbps=SOAK_LINK_GBPS) as bed, TestbedRay(bed) as cluster:
        run = bed.run_name.name
        nodes = {str(index): node for index, node in enumerate(cluster.node_ids)}
        options = json.dumps({"nodes": nodes, "updates": updates, "seed": seed, "max_evicted": max_evicted})
        driver = cluster.driver([sys.executable, "-m", "weightsync.cli.bench.soak_driver", options],
                                stdout=subprocess.PIPE)
        try:
            while (line := _line(driver)) is not None:
                if "result" in line:
                    result.problems += line["result"]["problems"]
                    if line["result"]["alive_actors"]:
                        result.problems.append(f"{line['result']['alive_actors']} actors alive after the shutdown")
                    break
                result.updates.append(line)
                say(_describe(line))
        finally:
            try:
                driver.wait(60)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait(30)
    if len(result.updates) != updates:
        result.problems.append(f"the driver ran {len(result.updates)} of {updates} updates")
    left = segments() - before_shm
    sweep_orphan_segments()
    result.swept = len(left - segments())
    result.problems += [f"ring segment left behind: /dev/shm/{name}" for name in sorted(segments() - before_shm)]
    result.problems += [f"namespace left behind: {name}" for name in sorted(namespaces(run))]
    return result


def _describe(line: dict[str, Any]) -> str:
    event = f" [{line['event']}]" if line["event"] else ""
    evicted = f", evicted {len(line.get('evicted', []))}" if line.get("evicted") else ""
    retried = ", second transfer" if line.get("retried") else ""
    retried += ", caught up from a peer" if line.get("joined") else ""
    return (f"update {line['version']:3d}{event}: {line['seconds']:.2f} s, {line.get('replicas', '?')} replicas, "
            f"received {'/'.join(line.get('received', ['?']))}{evicted}{retried}")


def run_soak(updates: int, seed: int, json_path: str | None) -> int:
    """``weightsync bench --soak``: run it, print the summary, write the JSON; 0 when it passed."""
    started = time.perf_counter()
    result = soak(updates, seed)
    events = [line["event"] for line in result.updates if line["event"]]
    print(f"soak: {len(result.updates)} updates in {time.perf_counter() - started:.0f} s, seed {seed}; events: "
          + ", ".join(f"{events.count(name)} {name}" for name in sorted(set(events)))
          + f"; {result.swept} ring segments of killed workers swept")
    for problem in result.problems:
        print(f"  FAILED: {problem}")
    print("soak: passed" if result.ok else "soak: FAILED")
    if json_path:
        with open(json_path, "w") as file:
            json.dump({"updates": result.updates, "problems": result.problems, "swept": result.swept,
                       "seed": seed}, file, indent=1)
    return 0 if result.ok else 1
