"""A worker's rail (``weightsync.core.transports.place.local_rail``): its local rank picks one of its host's rail
addresses, as a GPU node maps a GPU to its NIC; the metadata every worker gives (ping and prepare) carries it."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.api.errors import ConfigError, TransferError
from weightsync.api.types import WorkerContext
from weightsync.core.control.auto import AutoChoice, choose
from weightsync.core.control.rails import LostRails
from weightsync.core.transports.chain.topology import stripe_rails
from weightsync.core.transports.place import LOCAL_RANK_ENV, RAIL_ADDRS_ENV, Rail, devices_of, local_rail, ping_answer
from weightsync.core.transports.settings import EngineSettings


def test_without_rail_addresses_every_worker_is_on_rail_0_at_its_host_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RAIL_ADDRS_ENV, raising=False)
    monkeypatch.setenv(LOCAL_RANK_ENV, "5")
    assert local_rail("10.0.0.7") == Rail(rail=0, rail_address="10.0.0.7", rails=1)


@pytest.mark.parametrize(("local_rank", "rail"), [(None, 0), ("0", 0), ("1", 1), ("2", 0), ("7", 1)])
def test_the_local_rank_picks_a_rail_round_robin(monkeypatch: pytest.MonkeyPatch, local_rank: str | None,
                                                 rail: int) -> None:
    monkeypatch.setenv(RAIL_ADDRS_ENV, "198.18.0.2, 198.18.1.2")
    if local_rank is None:
        monkeypatch.delenv(LOCAL_RANK_ENV, raising=False)
    else:
        monkeypatch.setenv(LOCAL_RANK_ENV, local_rank)
    assert local_rail("198.18.0.2") == Rail(rail=rail, rail_address=f"198.18.{rail}.2", rails=2)
    answer = ping_answer(node_id="n", host_ip="198.18.0.2")
    assert (answer["rail"], answer["rail_address"], answer["rails"]) == (rail, f"198.18.{rail}.2", 2)


@pytest.mark.parametrize("local_rank", ["-1", "one", ""])
def test_a_malformed_local_rank_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch, local_rank: str) -> None:
    monkeypatch.setenv(RAIL_ADDRS_ENV, "198.18.0.2,198.18.1.2")
    monkeypatch.setenv(LOCAL_RANK_ENV, local_rank)
    with pytest.raises(ConfigError, match=LOCAL_RANK_ENV):
        local_rail("198.18.0.2")


def test_a_failed_update_s_rail_is_recorded_and_auto_deals_the_stripes_over_the_other_rails() -> None:
    lost = LostRails()
    lost.record(TransferError("stripe 1 failed", peer="p", rail=1, hosts=["a", "b"]))
    lost.record(TransferError("no rail named", peer="p"))
    lost.record(ConfigError("not a transfer"))
    lost.record(TransferError("rail 0 carries the control plane: not left out", peer="p", rail=0))
    assert lost.rails == {1}
    def dealt(lost_rails: set[int]) -> AutoChoice:
        return choose(sender_node="a", rollout_nodes=["b"] * 4, available=lambda: ["tcp"],
                      sender_rails=[0, 1, 2, 3], rollout_rails=[0, 1, 2, 3], lost_rails=lost_rails)

    assert dealt(set()).options["stripes"] == 4
    top = dealt({3})
    assert top.options["stripes"] == 3 and "rail 3 left out" in top.reason
    middle = dealt({1})  # a middle rail: the stripes go over the rails on either side of it
    assert middle.options["stripes"] == [0, 2, 3] and "rail 1 left out" in middle.reason
    assert middle.name == "tcp (two-level, 3 stripes: rails 0, 2, 3)"
    alone = dealt({1, 2, 3})
    assert "stripes" not in alone.options and "rails 1, 2, 3 left out" in alone.reason


def test_stripes_go_over_the_rails_every_host_has_rail_0_first() -> None:
    def rails(sender: list[int], rollout: list[tuple[str, int]], **options: Any) -> list[int]:
        return stripe_rails(sender_node="a", sender_rails=sender, rollout=rollout, **options)

    both = [("b", 0), ("b", 1), ("b", 3), ("c", 0), ("c", 1), ("c", 3)]
    assert rails([0, 1, 2, 3], both) == [0, 1, 3]  # rail 2 has no worker on b or c
    assert rails([0, 3], both) == [0, 3]  # the sender's host has actor ranks on rails 0 and 3 only
    assert rails([0, 1, 2, 3], both, limit=2) == [0, 1]
    assert rails([0, 1, 2, 3], both, wanted=[0, 3]) == [0, 3]
    assert rails([0, 1, 2, 3], both, leaving_out=[0, 1]) == [0, 3]  # rail 0 carries the control plane: kept
    assert rails([0, 1], [("b", 1), ("c", 0), ("c", 1)]) == [0]  # host b has no worker on rail 0
    assert rails([0, 1], [("a", 0), ("a", 1)]) == [0]  # nobody on another host


def test_a_probe_reaches_an_address_that_answers_even_with_a_refusal() -> None:
    answer = ping_answer(node_id="n", host_ip="127.0.0.1", probe=["127.0.0.1"])
    assert answer["reachable"] == {"127.0.0.1": True}  # nothing listens on the discard port: refused, so reached
    assert ping_answer(node_id="n", host_ip="127.0.0.1")["reachable"] == {}  # nothing asked, nothing probed


def test_a_rail_s_devices_are_the_interface_holding_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a library that picks its own interfaces (nixl's UCX) is held to on a host of rails: the interface that
    holds the worker's rail address; nothing for an address no interface holds, or without rail addresses."""
    assert devices_of("127.0.0.1") == ["lo"]
    assert devices_of("203.0.113.9") == []  # TEST-NET-3: on no interface here
    settings = EngineSettings(name="t", bucket_bytes=1 << 20, slots=2, timeout=1.0, verify_digest=True,
                              context=WorkerContext(role="rollout", rank=0, node_id="n", host_ip="127.0.0.1"))
    monkeypatch.delenv(RAIL_ADDRS_ENV, raising=False)
    assert settings.rail_devices == []
    monkeypatch.setenv(RAIL_ADDRS_ENV, "127.0.0.1,203.0.113.9")
    monkeypatch.setenv(LOCAL_RANK_ENV, "0")
    assert settings.rail_devices == ["lo"]
    monkeypatch.setenv(LOCAL_RANK_ENV, "1")
    assert settings.rail_devices == []
