"""A worker's rail (``weightsync.core.transports.settings.local_rail``): its local rank picks one of its host's rail
addresses, as a GPU node maps a GPU to its NIC; the metadata every worker gives (ping and prepare) carries it."""

from __future__ import annotations

import pytest

from weightsync.api.errors import ConfigError
from weightsync.core.control.host import ping_answer
from weightsync.core.transports.settings import LOCAL_RANK_ENV, RAIL_ADDRS_ENV, local_rail


def test_without_rail_addresses_every_worker_is_on_rail_0_at_its_host_address(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RAIL_ADDRS_ENV, raising=False)
    monkeypatch.setenv(LOCAL_RANK_ENV, "5")
    assert local_rail("10.0.0.7") == {"rail": 0, "rail_address": "10.0.0.7", "rails": 1}


@pytest.mark.parametrize(("local_rank", "rail"), [(None, 0), ("0", 0), ("1", 1), ("2", 0), ("7", 1)])
def test_the_local_rank_picks_a_rail_round_robin(monkeypatch: pytest.MonkeyPatch, local_rank: str | None,
                                                 rail: int) -> None:
    monkeypatch.setenv(RAIL_ADDRS_ENV, "198.18.0.2, 198.18.1.2")
    if local_rank is None:
        monkeypatch.delenv(LOCAL_RANK_ENV, raising=False)
    else:
        monkeypatch.setenv(LOCAL_RANK_ENV, local_rank)
    assert local_rail("198.18.0.2") == {"rail": rail, "rail_address": f"198.18.{rail}.2", "rails": 2}
    answer = ping_answer(node_id="n", host_ip="198.18.0.2")
    assert (answer["rail"], answer["rail_address"], answer["rails"]) == (rail, f"198.18.{rail}.2", 2)


@pytest.mark.parametrize("local_rank", ["-1", "one", ""])
def test_a_malformed_local_rank_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch, local_rank: str) -> None:
    monkeypatch.setenv(RAIL_ADDRS_ENV, "198.18.0.2,198.18.1.2")
    monkeypatch.setenv(LOCAL_RANK_ENV, local_rank)
    with pytest.raises(ConfigError, match=LOCAL_RANK_ENV):
        local_rail("198.18.0.2")
