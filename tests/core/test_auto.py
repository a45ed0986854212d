"""``backend="auto"``'s rule (``weightsync.core.control.auto.choose``), over what is installed; the manager's use of it on
one host and across hosts is tested with Ray (tests/adapters/ray/test_manager_ray.py, test_across_hosts.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from weightsync.api.errors import BackendUnavailableError
from weightsync.core.control.auto import choose, describe_rule
from weightsync.core.transports.place import has_rdma


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
    assert describe_rule(installed("shm", "nixl", "tcp"), rdma=False) == (
        "auto picks shm when every worker shares the sender's host, tcp (two-level) across hosts without RDMA "
        "devices; a chain in one stripe per rail where every host has several")
    assert describe_rule(installed("shm", "nixl", "tcp"), rdma=True).endswith(
        "nixl (two-level) across hosts with RDMA devices; a chain in one stripe per rail where every host has several")
    assert describe_rule(installed("shm", "gloo"), rdma=False).endswith("gloo across hosts without RDMA devices")
    assert "nothing (no network backend available)" in describe_rule(installed("shm"))


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


def test_delta_or_staged_updates_are_not_striped() -> None:
    choice = choose(sender_node="a", rollout_nodes=["b", "b"], available=installed("tcp"), sender_rails=[0, 1],
                    rollout_rails=[0, 1], striping=False)
    assert choice.options == {"layout": "two_level"}
