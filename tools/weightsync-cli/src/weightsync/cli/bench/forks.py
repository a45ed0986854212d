"""Bench workers on a testbed host, forked from one process per host that has already imported them (a fork server).

A bench worker spends about two seconds of CPU importing torch and weightsync before it answers its first command,
and a ``--hosts`` run starts one per rank for every entry (8 entries of 5 workers: 40 starts, most of a minute of this
machine's two cores). So each host runs one fork server for the whole run (``HostForks``): it imports the worker once,
then forks a worker per request. A forked worker is as fresh as a started one where the bench looks: its own process
in the host's namespaces, its own command channel, its own peak-RSS mark (taken after the fork, at ``mark``), no
torch thread or process group inherited (the server only imports).

The driver and the server talk over a ``SOCK_SEQPACKET`` socket pair (the server's stdin): each request is one JSON
packet; a ``fork`` request carries the worker's end of a fresh socket pair as ``SCM_RIGHTS``, which becomes the
worker's command channel (``multiprocessing`` framing, as a ``Pipe``). The server reaps its workers on ``reap``
(waiting at most the given seconds, then killing); on the driver's end of the pair closing it kills what is left and
exits. The testbed kills everything in a host at teardown either way (its processes share the host's PID namespace).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from weightsync.cli.bench.worker import serve

__all__ = ["FORK_SERVER_ARGV", "ForkServerError", "HostForks", "serve_forks"]

FORK_SERVER_ARGV = (sys.executable, "-c", "from weightsync.cli.bench.forks import serve_forks; serve_forks()")
PACKET = 64 * 1024
REAP_POLL_S = 0.01
KILL_WAIT_S = 15.0
ANSWER_S = 30.0
"""How long the driver waits for a fork server's answer beyond what the request itself may take."""


class ForkServerError(RuntimeError):
    """A host's fork server did not answer as it should (it died: its output is above)."""


class HostForks:
    """The driver's end of one host's fork server: ``fork`` a worker, ``reap`` it."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control

    @staticmethod
    def pair() -> tuple[socket.socket, socket.socket]:
        """The driver's and the server's ends of a new control channel (the server's end becomes its stdin)."""
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def _ask(self, request: dict[str, Any], fds: list[int] | None = None, *, takes: float = 0.0) -> dict[str, Any]:
        payload = json.dumps(request).encode()
        try:
            self.control.settimeout(takes + ANSWER_S)
            if fds:
                socket.send_fds(self.control, [payload], fds)
            else:
                self.control.send(payload)
            reply = self.control.recv(PACKET)
        except TimeoutError as error:
            raise ForkServerError(f"a host's fork server did not answer {request['op']} within "
                                  f"{takes + ANSWER_S:.0f} s") from error
        except OSError as error:
            raise ForkServerError(f"a host's fork server is gone ({error})") from error
        if not reply:
            raise ForkServerError("a host's fork server is gone (it closed its end)")
        answer: dict[str, Any] = json.loads(reply)
        return answer

    def fork(self) -> tuple[Connection, int]:
        """A new worker: its command channel (the first message it expects is its spec) and its pid in the host."""
        ours, theirs = socket.socketpair()
        try:
            pid = int(self._ask({"op": "fork"}, [theirs.fileno()])["pid"])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return Connection(ours.detach()), pid

    def reap(self, pid: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for worker ``pid`` to exit, then kill it; True where it had to be killed."""
        return bool(self._ask({"op": "reap", "pid": pid, "timeout": timeout}, takes=timeout + KILL_WAIT_S)["killed"])

    def close(self) -> None:
        self.control.close()


def _wait(pid: int, timeout: float) -> bool:
    """Reap ``pid`` within ``timeout`` seconds; False if it still runs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done or time.monotonic() >= deadline:
            return bool(done)
        time.sleep(REAP_POLL_S)


def _reap(pid: int, timeout: float) -> bool:
    """``reap``: True where the worker had to be killed."""
    if _wait(pid, timeout):
        return False
    os.kill(pid, signal.SIGKILL)
    _wait(pid, KILL_WAIT_S)
    return True


def _run_worker(fd: int, control: socket.socket) -> None:
    """In the forked child: serve the worker over its channel, then exit without the server's cleanup."""
    code = 1
    try:
        control.close()
        channel = Connection(fd)
        try:
            serve(channel, json.loads(channel.recv_bytes()))
        except EOFError:
            pass  # the driver went away: nothing left to answer
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve_forks() -> None:
    """A host's fork server (the worker imported once, with this module): stdin is its control socket; output goes
    to stderr, whatever prints."""
    control = socket.socket(fileno=os.dup(0))
    # Only ``control`` holds the server's end from here (closed in every worker): were a worker to keep it open,
    # the driver would not see the server's end close when the server dies.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    children: set[int] = set()
    try:
        while True:
            message, fds, _, _ = socket.recv_fds(control, PACKET, 1)
            if not message:
                return  # the driver closed its end
            request = json.loads(message)
            if request["op"] == "fork":
                pid = os.fork()
                if pid == 0:
                    _run_worker(fds[0], control)
                os.close(fds[0])
                children.add(pid)
                control.send(json.dumps({"pid": pid}).encode())
            elif request["op"] == "reap":
                killed = _reap(request["pid"], request["timeout"])
                children.discard(request["pid"])
                control.send(json.dumps({"killed": killed}).encode())
    finally:
        for pid in children:
            _reap(pid, 0.0)
