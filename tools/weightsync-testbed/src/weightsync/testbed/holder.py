"""The process that holds a host's namespaces: pid 1 of the host, alive exactly as long as the host.

Why a process and not bind-mounted namespace files: a host is a network namespace (named, persistent, from
``ip netns add``) plus mount, IPC, UTS and PID namespaces. The last four are held by one small Python process, the
*holder*, started as ``ip netns exec <netns> unshare --mount --ipc --uts --pid --fork --mount-proc``:

- it is pid 1 of the host's PID namespace, so when it dies the kernel kills every process of the host, whatever
  they forked or daemonised; teardown is one SIGKILL and cannot miss a process;
- it dies by itself when its owner dies (it watches a pipe from the owner and exits on EOF): a killed run leaves no
  running processes, only the named network namespaces, which :func:`cleanup` removes;
- nothing is bind-mounted on the machine: the mount namespace, its private ``/dev/shm`` and its ``/etc/hosts``
  vanish with the holder. Its mounts are slaves of the machine's: a mount the machine makes later (where output
  files go, say) still reaches the hosts, and the hosts' own mounts never reach the machine.

Inside its namespaces the holder sets the hostname, mounts a fresh tmpfs on ``/dev/shm`` (so POSIX shared memory
cannot cross hosts; its own IPC namespace does the same for System V IPC), bind-mounts the testbed's hosts file
over ``/etc/hosts`` (so ``gethostbyname(gethostname())`` resolves to the host's testbed address, without touching
the machine's file) and reaps orphans, as a pid 1 must. Separate PID namespaces also keep a process from naming a
process of another host, so cross-memory attach (``process_vm_readv``, UCX's CMA) cannot cross hosts either.

The holder runs the interpreter running the testbed, isolated (``-I -S``): it imports nothing but the stdlib.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from weightsync.testbed.system import TestbedError, Tools, process_start_ticks

__all__ = ["HOLDER_SCRIPT", "Holder", "start_holder", "wait_ready"]

# argv: hostname, mount binary, tmpfs options for /dev/shm, hosts file ('' for none), lifetime in seconds.
HOLDER_SCRIPT = r"""
import os, select, socket, subprocess, sys, time

def mount(*args):
    done = subprocess.run([MOUNT, *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        sys.stderr.write("mount %s: %s\n" % (" ".join(args), done.stderr.strip()))
        sys.exit(1)

hostname, MOUNT, shm_options, hosts_file, lifetime = sys.argv[1:6]
socket.sethostname(hostname)
mount("-t", "tmpfs", "-o", shm_options, "wst-shm", "/dev/shm")
if hosts_file and os.path.exists("/etc/hosts"):
    mount("--bind", hosts_file, "/etc/hosts")
sys.stdout.write("ready\n")
sys.stdout.flush()
deadline = time.monotonic() + float(lifetime)
while time.monotonic() < deadline:
    readable, _, _ = select.select([0], [], [], 0.5)
    if readable and not os.read(0, 4096):
        break  # the owner closed its end (exited or was killed): the host goes with it
    for _ in range(1024):  # reap orphans re-parented to us, pid 1
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
"""

READY_TIMEOUT_S = 20.0


@dataclass
class Holder:
    """A running holder: ``process`` is the ``unshare`` parent (our child), ``pid`` the holder (pid 1 inside)."""

    process: subprocess.Popen[bytes]
    pid: int
    start_ticks: int | None

    def alive(self) -> bool:
        return self.process.poll() is None


def start_holder(
    tools: Tools, netns: str, *, hostname: str, hosts_file: str, shm_bytes: int | None, lifetime_s: float
) -> subprocess.Popen[bytes]:
    """Start a holder in ``netns``; :func:`wait_ready` then waits for it (start all hosts' first, then wait)."""
    shm_options = "mode=1777,nosuid,nodev" + (f",size={shm_bytes}" if shm_bytes else "")
    argv = [
        tools.ip, "netns", "exec", netns,
        tools.unshare, "--mount", "--ipc", "--uts", "--pid", "--fork", "--mount-proc", "--propagation", "slave",
        "--", sys.executable, "-I", "-S", "-c", HOLDER_SCRIPT,
        hostname, tools.mount, shm_options, hosts_file, f"{lifetime_s:g}",
    ]
    # A session of its own: a Ctrl-C in the terminal reaches the owner, whose teardown then removes the host.
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def wait_ready(process: subprocess.Popen[bytes], *, what: str, deadline: float) -> Holder:
    """Wait (until ``deadline``, monotonic) for the holder's ``ready`` line; the Holder, or TestbedError."""
    if process.stdout is None or process.stderr is None:
        raise TestbedError(f"{what}: namespace holder started without pipes")
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TestbedError(f"{what}: its namespace holder was not ready within {READY_TIMEOUT_S:g} s")
        readable, _, _ = select.select([process.stdout], [], [], left)
        if not readable:
            continue
        chunk = os.read(process.stdout.fileno(), 64)
        if not chunk:
            break
        line += chunk
    if line.strip() != b"ready":
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
        error = process.stderr.read().decode(errors="replace").strip().replace("\n", "; ")
        raise TestbedError(f"{what}: namespace holder failed (exit {process.returncode}): {error}")
    pid = _only_child(process.pid, deadline)
    if pid is None:
        raise TestbedError(f"{what}: namespace holder reported ready but its process is not found")
    # Nothing more is read from the holder: close our ends so no pipe outlives the host.
    process.stdout.close()
    process.stderr.close()
    return Holder(process=process, pid=pid, start_ticks=process_start_ticks(pid))


def _only_child(parent: int, deadline: float) -> int | None:
    """The one child of ``unshare --fork``: the holder, as the machine sees it (inside it is pid 1)."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as children:
                pids = [int(token) for token in children.read().split()]
        except OSError:
            return None
        if pids:
            return pids[0]
        time.sleep(0.01)
    return None
