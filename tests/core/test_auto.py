"""``backend="auto"``'s rule (``weightsync.core.control.auto.choose``), over what is installed; the manager's use of it on
one host and across hosts is tested with Ray (tests/adapters/ray/test_manager_ray.py, test_across_hosts.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from weightsync.api.errors import BackendUnavailableError
from weightsync.api.registry import load_engine_class
from weightsync.core.control.auto import DEFAULT_SLOTS, choose, describe_rule, describe_shm
from weightsync.core.control.setup import shm_free
from weightsync.core.transports.place import PingAnswer, has_rdma
from weightsync.core.transports.sharedmem import ShmSpace

MiB = 1 << 20
ROOMY = ShmSpace(size=8192 * MiB, free=8000 * MiB)
DOCKER = ShmSpace(size=64 * MiB, free=64 * MiB)


def installed(*names: str) -> Callable[[], list[str]]:
    return lambda: list(names)


def test_one_host_is_shm() -> None:
    choice = choose(sender_node="a", rollout_nodes=["a", "a"], available=installed("shm", "gloo", "nixl"))
    assert (choice.backend, choice.options, choice.name) == ("shm", {}, "shm")
    assert "shares the sender's host" in choice.reason


@pytest.mark.parametrize("rdma, names, backend, options", [
    (False, ("shm", "gloo", "nixl", "mooncake", "tcp"), "tcp", {"layout": "two_level"}),
    (False, ("shm", "gloo", "nixl", "mooncake"), "nixl", {"layout": "two_level"}),
    (False, ("shm", "gloo", "mooncake"), "mooncake", {"layout": "two_level"}),
    (False, ("shm", "gloo"), "gloo", {}),
    (True, ("shm", "gloo", "nixl", "mooncake", "tcp"), "nixl", {"layout": "two_level"}),
    (True, ("shm", "gloo", "mooncake", "tcp"), "mooncake", {"layout": "two_level"}),
    (True, ("shm", "gloo", "tcp"), "tcp", {"layout": "two_level"}),
])
def test_across_hosts_the_fastest_network_transport(rdma: bool, names: tuple[str, ...], backend: str,
                                                     options: dict[str, str]) -> None:
    """Without RDMA devices on every host the plain-socket chain is fastest (UCX would use TCP too); with them,
    the one-sided libraries."""
    choice = choose(sender_node="a", rollout_nodes=["a", "b", "c"], rdma=rdma, available=installed(*names))
    assert (choice.backend, choice.options) == (backend, options)
    assert "3 hosts" in choice.reason
    assert ("with RDMA devices" in choice.reason) is rdma
    assert choice.name == (f"{backend} (two-level)" if options else backend)


def test_one_host_without_shm_falls_back_to_the_network() -> None:
    choice = choose(sender_node="a", rollout_nodes=["a"], available=installed("gloo"))
    assert choice.backend == "gloo" and "shm is not available" in choice.reason


def test_nothing_crosses_hosts() -> None:
    with pytest.raises(BackendUnavailableError, match="install one of: tcp"):
        choose(sender_node="a", rollout_nodes=["b"], available=installed("shm"))


def test_describe_rule() -> None:
    assert describe_rule(installed("shm", "nixl", "tcp"), rdma=False, space=ROOMY) == (
        "auto picks shm when every worker shares the sender's host, tcp (two-level) across hosts without RDMA "
        "devices; a chain in one stripe per rail where every host has several")
    assert describe_rule(installed("shm", "nixl", "tcp"), rdma=True, space=ROOMY).endswith(
        "nixl (two-level) across hosts with RDMA devices; a chain in one stripe per rail where every host has several")
    assert describe_rule(installed("shm", "gloo"), rdma=False, space=ROOMY).endswith(
        "gloo across hosts without RDMA devices")
    assert "nothing (no network backend available)" in describe_rule(installed("shm"), space=ROOMY)
    assert describe_rule(installed("shm", "nixl", "tcp"), rdma=False, space=DOCKER) == (
        "auto picks tcp (flat chain: /dev/shm too small) when every worker shares the sender's host, tcp (flat "
        "chain: /dev/shm too small) across hosts without RDMA devices")


def test_a_ring_that_does_not_fit_in_dev_shm_turns_auto_to_a_flat_chain() -> None:
    """shm's ring is 4 slots of bucket_bytes, the two-level host ring 2: where a host's /dev/shm has less room,
    auto picks the flat chain, which maps nothing there, and says which host and what it has (negative controls:
    the same with room to spare, or with smaller buckets)."""
    names = installed("shm", "gloo", "tcp")
    one_host = choose(sender_node="a", rollout_nodes=["a", "a"], available=names, shm_free={"a": 64 * MiB})
    assert (one_host.backend, one_host.options) == ("tcp", {})
    assert "/dev/shm on a has 64.0 MiB free and shm's ring needs 256.0 MiB" in one_host.reason, one_host.reason
    assert choose(sender_node="a", rollout_nodes=["a"], available=names, shm_free={"a": 256 * MiB}).backend == "shm"
    assert choose(sender_node="a", rollout_nodes=["a"], available=names, shm_free={"a": 64 * MiB},
                  bucket_bytes=16 * MiB).backend == "shm"
    across = choose(sender_node="a", rollout_nodes=["b", "b", "c", "c"], available=names, sender_rails=[0, 1],
                    rollout_rails=[0, 1, 0, 1], shm_free={"a": 8000 * MiB, "b": 8000 * MiB, "c": 100 * MiB})
    assert (across.backend, across.options) == ("tcp", {}), across  # flat: no host ring, so no stripes either
    assert "/dev/shm on c has 100.0 MiB free and the two-level layout's host ring needs 128.0 MiB" in across.reason
    roomy = choose(sender_node="a", rollout_nodes=["b", "c"], available=names, shm_free={"c": 128 * MiB})
    assert roomy.options == {"layout": "two_level"}, roomy  # b did not say: taken to have room


def test_the_rings_auto_counts_are_the_engines_defaults() -> None:
    assert DEFAULT_SLOTS == {"shm": load_engine_class("shm").default_slots,  # type: ignore[attr-defined]
                             "two_level": load_engine_class("tcp").default_slots}  # type: ignore[attr-defined]


def test_the_room_of_a_node_is_the_most_any_of_its_workers_could_map() -> None:
    """The worker holding the host's ring counts it as room (its next ring reuses it); a worker that did not say
    (-1) is left out, a node none of whose workers said is not in it."""
    answers = [PingAnswer(node_id="a", shm_free=10), PingAnswer(node_id="a", shm_free=300),
               PingAnswer(node_id="b", shm_free=-1), PingAnswer(node_id="c", shm_free=0)]
    assert shm_free(answers) == {"a": 300, "c": 0}


def test_describe_shm_says_what_fits() -> None:
    roomy = describe_shm(ROOMY)
    assert roomy == ("/dev/shm: 8192.0 MiB, 8000.0 MiB free; at 64 MiB buckets shm's ring needs 256 MiB (fits); a "
                     "two-level host ring needs 128 MiB (fits)")
    docker = describe_shm(DOCKER)
    assert "shm's ring needs 256 MiB (does NOT fit); a two-level host ring needs 128 MiB (does NOT fit)" in docker
    assert "--shm-size" in docker and "SharedMemoryFullError" in docker


def test_has_rdma_reads_the_kernels_device_class(tmp_path: Path) -> None:
    """An RDMA device is an entry under /sys/class/infiniband (mlx5_0, rxe0, ...); an empty or missing class is
    none (negative control: the same directory with a device in it)."""
    assert not has_rdma(str(tmp_path / "missing"))
    assert not has_rdma(str(tmp_path))
    (tmp_path / "mlx5_0").mkdir()
    assert has_rdma(str(tmp_path))


@pytest.mark.parametrize("sender_rails, rollout_rails, stripes", [
    ([0, 1], [0, 1, 0, 1], 2),
    ([0, 1, 2, 3], [0, 1, 2, 3, 0, 1], 2),  # host c has two rails' workers: two stripes
    ([0], [0, 1, 0, 1], 1),  # one actor rank on the sender's host: one sender
    ([0, 1], [0, 0, 0, 1], 1),  # host b's workers are all on rail 0
    ([0, 1], None, 1),  # workers that report no rail: rail 0
])
def test_several_rails_everywhere_deal_the_update_into_stripes(
        sender_rails: list[int], rollout_rails: list[int] | None, stripes: int) -> None:
    nodes = ["b", "b", "c", "c"] if rollout_rails is None or len(rollout_rails) == 4 else ["b"] * 4 + ["c"] * 2
    choice = choose(sender_node="a", rollout_nodes=nodes, available=installed("shm", "tcp"),
                    sender_rails=sender_rails, rollout_rails=rollout_rails)
    assert choice.options.get("stripes", 1) == stripes
    if stripes > 1:
        assert choice.name == f"tcp (two-level, {stripes} stripes)"
        assert f"dealt into {stripes} stripes, one per rail" in choice.reason
    else:
        assert choice.name == "tcp (two-level)" and "stripes" not in choice.reason


def test_delta_updates_are_not_striped() -> None:
    choice = choose(sender_node="a", rollout_nodes=["b", "b"], available=installed("tcp"), sender_rails=[0, 1],
                    rollout_rails=[0, 1], striping=False)
    assert choice.options == {"layout": "two_level"}
