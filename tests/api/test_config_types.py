from __future__ import annotations

import pytest

from weightsync.api import SyncConfig, StepTimeouts, Topology
from weightsync.api.errors import ConfigError, TopologyError


@pytest.mark.parametrize("bucket_bytes", [0, -256, 100, 257, True])
def test_bad_bucket_sizes_are_rejected(bucket_bytes: int) -> None:
    with pytest.raises(ConfigError, match="bucket_bytes"):
        SyncConfig(bucket_bytes=bucket_bytes)


def test_bad_timeouts_and_slots_are_rejected() -> None:
    with pytest.raises(ConfigError, match="timeouts.transfer"):
        StepTimeouts(transfer=0)
    with pytest.raises(ConfigError, match="slots"):
        SyncConfig(slots=0)
    with pytest.raises(ConfigError, match="plain data"):
        SyncConfig(backend_options={"hook": object()})  # type: ignore[dict-item]


def test_config_round_trips_as_plain_data() -> None:
    config = SyncConfig(bucket_bytes=1 << 20, timeouts=StepTimeouts(transfer=5), backend_options={"a": [1, 2]})
    assert SyncConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown SyncConfig fields"):
        SyncConfig.from_dict({"bucket_size": 5})


def test_topology_check() -> None:
    topology = Topology(actor=[{}, {}], rollout=[{}], senders=(0,))
    topology.check(actor_wg_world_size=2, rollout_world_size=1)
    with pytest.raises(TopologyError, match="actor entries"):
        topology.check(actor_wg_world_size=3, rollout_world_size=1)
    with pytest.raises(TopologyError, match="not distinct actor ranks"):
        Topology(actor=[{}], rollout=[], senders=(1,)).check(actor_wg_world_size=1, rollout_world_size=0)
