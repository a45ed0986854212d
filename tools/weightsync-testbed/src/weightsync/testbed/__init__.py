"""An emulated multi-host testbed: H hosts on this machine, each behind its own shaped link to one switch (or K
links, ``rails=K``, each to a switch of its own: a rail-optimised fabric, as GPU nodes with a NIC per GPU have).

What a host is: a named network namespace plus private mount, IPC, UTS and PID namespaces, so that its processes
share a ``/dev/shm`` of their own (a tmpfs) and nothing else with other hosts. Its link is a veth pair to a bridge
in a namespace of its own, shaped both ways with ``tc tbf`` (optionally delayed with ``netem``), and counted from
the switch side. Addresses come from 198.18.0.0/15; the machine's interfaces, routes and ``/dev/shm`` are never
touched. Needs root, iproute2 and util-linux.

How a bench driver uses it::

    from weightsync.testbed import Testbed, TestbedUnavailable

    with Testbed(4, link_gbps=2.0) as testbed:                 # hosts 0..3, built here, removed on exit
        receivers = [testbed.popen(h, [sys.executable, "-m", "worker", "--recv"], stdout=PIPE)
                     for h in range(1, 4)]
        before = testbed.counters()
        testbed.run(0, [sys.executable, "-m", "worker", "--send", testbed.hosts[1].address], timeout=120)
        after = testbed.counters()
        sender_egress = (after[0] - before[0]).egress_bytes
        host_ingress = [(after[h] - before[h]).ingress_bytes for h in range(1, 4)]

Per rail: ``testbed.rail_counters()[h][k]``; ``counters()`` is each host's total over its rails.
Fault tests: ``testbed.link_down(h)`` (``mode="drop"`` or ``"carrier"``; ``rail=k`` for one rail, every rail by
default) mid-update, ``testbed.link_up(h)``.
A Ray cluster across the hosts (a raylet in each, a driver started in the head's host): ``TestbedRay(testbed)``
(``raycluster``).
A killed run's leftovers: :func:`cleanup`. Design notes live in the submodules: ``bed`` (layout, identity),
``holder`` (how namespaces are held and why), ``links`` (shaping, link down, counters), ``cleanup``, ``probe``
(when the testbed is unavailable), ``signals``.
"""

from importlib.metadata import version as _version

from weightsync.testbed.bed import (
    ENV_ADDR,
    ENV_HOST,
    ENV_HOSTS,
    ENV_NODE_ID,
    ENV_RAIL_ADDRS,
    ENV_RUN,
    Host,
    Testbed,
)
from weightsync.testbed.cleanup import CleanupError, CleanupReport, cleanup
from weightsync.testbed.links import LinkCounters, LinkMode, Rail, tbf_burst_bytes
from weightsync.testbed.probe import REQUIRE_ENV, Capabilities, probe, testbed_required, unavailable_reason
from weightsync.testbed.processes import HostProcess
from weightsync.testbed.raycluster import TestbedRay, testbed_host_resource
from weightsync.testbed.system import PREFIX, TestbedError, TestbedUnavailable

__version__ = _version("weightsync-testbed")
"""This distribution's version (from its installed metadata)."""

__all__ = [
    "ENV_ADDR",
    "ENV_HOST",
    "ENV_HOSTS",
    "ENV_NODE_ID",
    "ENV_RAIL_ADDRS",
    "ENV_RUN",
    "PREFIX",
    "REQUIRE_ENV",
    "Capabilities",
    "CleanupError",
    "CleanupReport",
    "Host",
    "HostProcess",
    "LinkCounters",
    "LinkMode",
    "Rail",
    "Testbed",
    "TestbedError",
    "TestbedRay",
    "TestbedUnavailable",
    "cleanup",
    "probe",
    "tbf_burst_bytes",
    "testbed_host_resource",
    "testbed_required",
    "unavailable_reason",
]
