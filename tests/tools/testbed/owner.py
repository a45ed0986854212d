"""A process that owns a testbed, for the lifecycle tests: ``python owner.py with|start``.

Builds a 2-host testbed (``with``: in a with block; ``start``: ``start()`` only, relying on the signal handlers and
atexit), starts a sleeper in host 1 and a daemonised sleeper in host 0, prints one JSON line (the run's name, its
namespaces) and sleeps at most 120 s, waiting to be signalled or killed.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from weightsync.testbed import Testbed


def hold(testbed: Testbed) -> None:
    testbed.popen(1, ["sleep", "600"])
    testbed.run(0, ["sh", "-c", "setsid sleep 600 > /dev/null 2>&1 < /dev/null &"], timeout=30)
    netns = [testbed.switch_netns, *(entry.netns for entry in testbed.hosts)]
    print(json.dumps({"run": testbed.run_name.name, "netns": netns}), flush=True)
    time.sleep(120)


def main(mode: str) -> None:
    # The owner a user starts from a shell: SIGHUP at its default. A test run started under nohup passes SIGHUP on
    # ignored, and the testbed leaves an ignored signal alone (it only replaces defaults), so the owner would
    # never see the SIGHUP the test sends.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    testbed = Testbed(2, link_gbps=1.0)
    if mode == "with":
        with testbed:
            hold(testbed)
    else:
        hold(testbed.start())


if __name__ == "__main__":
    main(sys.argv[1])
