"""What makes a host a host: its own /dev/shm, IPC, PID and UTS namespaces and identity, its own addresses, and
no change at all to the machine's interfaces, routes or /dev/shm."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import uuid

from weightsync.testbed import ENV_ADDR, ENV_HOST, ENV_HOSTS, ENV_NODE_ID, ENV_RUN, Testbed

from tests.tools.testbed.support import machine_network, read_line, start_or_skip

BENCH_RANGE = ipaddress.ip_network("198.18.0.0/15")


def shell(testbed: Testbed, host: int, script: str) -> str:
    return testbed.run(host, ["sh", "-c", script], timeout=30).stdout.decode()


def test_dev_shm_is_private_to_each_host_and_shared_within_it(testbed: Testbed) -> None:
    name = f"wst-test-{uuid.uuid4().hex}"
    shell(testbed, 1, f"echo host1 > /dev/shm/{name}")
    try:
        # Another process of the same host sees it (a host's processes share its /dev/shm)...
        assert shell(testbed, 1, f"cat /dev/shm/{name}").strip() == "host1"
        # ...no other host does, and neither does the machine.
        assert shell(testbed, 2, f"test -e /dev/shm/{name} && echo seen || echo absent").strip() == "absent"
        assert shell(testbed, 0, f"test -e /dev/shm/{name} && echo seen || echo absent").strip() == "absent"
        assert not os.path.exists(f"/dev/shm/{name}")
        # POSIX shared memory goes through /dev/shm: a segment made in host 1 cannot be opened in host 2.
        create = ("from multiprocessing import shared_memory as s; m = s.SharedMemory(name=%r, create=True, size=4096);"
                  "m.buf[:5] = b'hello'; m.close()" % (name + "-posix"))
        attach = ("from multiprocessing import shared_memory as s\ntry:\n    s.SharedMemory(name=%r)\n    print('attached')\n"
                  "except FileNotFoundError:\n    print('absent')" % (name + "-posix"))
        testbed.run(1, [sys.executable, "-c", create], timeout=30)
        assert testbed.run(2, [sys.executable, "-c", attach], timeout=30).stdout.decode().strip() == "absent"
        assert not os.path.exists(f"/dev/shm/{name}-posix")
    finally:
        shell(testbed, 1, f"rm -f /dev/shm/{name} /dev/shm/{name}-posix")


def test_each_host_has_its_own_namespaces_shared_by_its_processes(testbed: Testbed) -> None:
    kinds = ("net", "mnt", "ipc", "uts", "pid")
    script = "; ".join(f"readlink /proc/self/ns/{kind}" for kind in kinds)
    machine = [os.readlink(f"/proc/self/ns/{kind}") for kind in kinds]
    seen = [shell(testbed, host, script).split() for host in range(3)]
    again = shell(testbed, 1, script).split()
    assert again == seen[1]
    for index, kind in enumerate(kinds):
        values = {host[index] for host in seen}
        assert len(values) == 3, f"{kind} namespaces shared between hosts: {seen}"
        assert machine[index] not in values, f"a host is in the machine's {kind} namespace"


def test_a_host_cannot_see_another_hosts_processes(testbed: Testbed) -> None:
    marker = f"wst-marker-{uuid.uuid4().hex}"
    sleeper = testbed.popen(2, [sys.executable, "-c", f"import time; print('up', flush=True); time.sleep(30) # {marker}"],
                            stdout=subprocess.PIPE)
    try:
        assert read_line(sleeper, 20) == "up"
        listing = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"
        assert marker in shell(testbed, 2, listing)
        assert marker not in shell(testbed, 1, listing)
    finally:
        sleeper.kill()
        sleeper.wait(10)
    assert sleeper.returncode is not None


def test_node_identity_hostname_environment_and_name_resolution(testbed: Testbed) -> None:
    for entry in testbed.hosts:
        fields = shell(testbed, entry.index, f'hostname; echo "${ENV_HOST} ${ENV_HOSTS} ${ENV_NODE_ID} ${ENV_ADDR} '
                                            f'${ENV_RUN}"; getent hosts $(hostname)').split()
        assert fields[0] == entry.hostname == f"wst-h{entry.index}"
        assert fields[1:6] == [str(entry.index), "3", entry.netns, entry.address, testbed.run_name.name]
        assert fields[6:8] == [entry.address, entry.hostname]
        assert testbed.env(entry.index)[ENV_NODE_ID] == entry.netns
    assert os.uname().nodename not in {entry.hostname for entry in testbed.hosts}


def test_addresses_come_from_the_benchmark_range_and_nothing_routes_out(testbed: Testbed) -> None:
    for entry in testbed.hosts:
        addresses = shell(testbed, entry.index, "ip -o -4 addr show scope global | awk '{print $4}'").split()
        assert addresses == [f"{entry.address}/24"]
        assert ipaddress.ip_interface(addresses[0]).network.subnet_of(BENCH_RANGE)  # type: ignore[arg-type]
        routes = shell(testbed, entry.index, "ip route show table all | grep -v '^local\\|^broadcast\\|^multicast'")
        assert "default" not in routes
        assert routes.split()[0] == "198.18.0.0/24", routes
    # The switch only switches: its bridge and ports have no address.
    switch = subprocess.run(["ip", "-n", testbed.switch_netns, "-o", "addr", "show"], capture_output=True, text=True,
                            timeout=15, check=True).stdout
    assert "inet" not in switch.replace("inet 127.0.0.1", "")


def test_the_machines_interfaces_routes_and_dev_shm_stay_as_they_were() -> None:
    before, shm_before = machine_network(), sorted(os.listdir("/dev/shm"))
    with start_or_skip(Testbed(2, link_gbps=1.0)) as bed:
        shell(bed, 1, "echo x > /dev/shm/wst-probe-file")
        during, shm_during = machine_network(), sorted(os.listdir("/dev/shm"))
    after, shm_after = machine_network(), sorted(os.listdir("/dev/shm"))
    assert before == during == after
    assert shm_before == shm_during == shm_after
