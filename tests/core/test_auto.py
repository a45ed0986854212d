"""``backend="auto"``'s rule (``weightsync.core.auto.choose``), over what is installed; the manager's use of it on
one host and across hosts is tested with Ray (tests/adapters/ray/test_manager_ray.py, test_across_hosts.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from weightsync.api.errors import BackendUnavailableError
from weightsync.core.auto import choose, describe_rule


def installed(*names: str) -> Callable[[], list[str]]:
    return lambda: list(names)


def test_one_host_is_shm() -> None:
    choice = choose(sender_node="a", rollout_nodes=["a", "a"], available=installed("shm", "gloo", "nixl"))
    assert (choice.backend, choice.options, choice.name) == ("shm", {}, "shm")
    assert "shares the sender's host" in choice.reason


@pytest.mark.parametrize("names, backend, options", [
    (("shm", "gloo", "nixl", "mooncake"), "nixl", {"layout": "two_level"}),
    (("shm", "gloo", "mooncake"), "mooncake", {"layout": "two_level"}),
    (("shm", "gloo"), "gloo", {}),
])
def test_across_hosts_the_fastest_network_transport(names: tuple[str, ...], backend: str,
                                                     options: dict[str, str]) -> None:
    choice = choose(sender_node="a", rollout_nodes=["a", "b", "c"], available=installed(*names))
    assert (choice.backend, choice.options) == (backend, options)
    assert "3 hosts" in choice.reason
    assert choice.name == (f"{backend} (two-level)" if options else backend)


def test_one_host_without_shm_falls_back_to_the_network() -> None:
    choice = choose(sender_node="a", rollout_nodes=["a"], available=installed("gloo"))
    assert choice.backend == "gloo" and "shm is not available" in choice.reason


def test_nothing_crosses_hosts() -> None:
    with pytest.raises(BackendUnavailableError, match="install one of: nixl"):
        choose(sender_node="a", rollout_nodes=["b"], available=installed("shm"))


def test_describe_rule() -> None:
    assert describe_rule(installed("shm", "nixl")) == (
        "auto picks shm when every worker shares the sender's host, nixl (two-level) across hosts")
    assert "nothing (no network backend available)" in describe_rule(installed("shm"))
