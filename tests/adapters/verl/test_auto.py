"""``weightsync.auto`` in verl: the adapter's default backend. verl's workers build no engine for it; weightsync's
drop-in manager asks every worker where it runs, picks the backend ``weightsync.core.control.auto`` would for those nodes,
and has each worker build that engine at prepare."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineManager as VerlManager  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402
from weightsync.api.errors import ConfigError  # noqa: E402
from weightsync.core.control.auto import choose  # noqa: E402
from weightsync.core.transports.place import default_node_id  # noqa: E402
from weightsync.verl import CheckpointEngineManager  # noqa: E402
from weightsync.verl.config import read_checkpoint_config  # noqa: E402

from tests.adapters.verl.conftest import VerlWorld  # noqa: E402
from tests.adapters.verl.workloads import STEPPED, mismatches, model_weights  # noqa: E402


def nodes_of(world: VerlWorld) -> list[str]:
    """Each worker's host as its own process sees it (hostname and boot id; actor ranks first): two raylets on one
    machine share its memory, so Ray's node ids do not tell hosts apart here."""
    import ray

    def node(worker: Any) -> str:
        return str(ray.get(worker.__ray_call__.remote(lambda self: default_node_id())))

    return [node(worker) for worker in world.actor_wg.workers] + [
        node(worker) for replica in world.replicas for worker in replica.workers]


def test_an_unnamed_backend_is_auto() -> None:
    assert read_checkpoint_config({}).backend == "weightsync.auto"
    assert read_checkpoint_config({"backend": ""}).backend == "weightsync.auto"
    assert read_checkpoint_config({"backend": "weightsync.gloo"}).backend == "weightsync.gloo"
    with pytest.raises(ConfigError, match="must name a backend"):
        read_checkpoint_config({"backend": 3})
    assert CheckpointEngineRegistry.get("weightsync.auto").backend == "auto"


def test_weightsyncs_manager_picks_the_backend_and_moves_weights_bit_exact(verl_auto_world: VerlWorld) -> None:
    manager = CheckpointEngineManager(config=verl_auto_world.config, actor_wg=verl_auto_world.actor_wg,
                                      replicas=verl_auto_world.replicas)
    nodes = nodes_of(verl_auto_world)
    expected = choose(sender_node=nodes[0], rollout_nodes=nodes[1:])
    for step in (3, 4):
        verl_auto_world.set_model(step)
        manager.update_weights(step)
        report = manager.last_report
        assert report is not None and report.ok
        assert report.chosen.startswith(f"{expected.name}: "), (report.chosen, nodes)
        for tensors, _ in verl_auto_world.received():
            assert mismatches(tensors, model_weights(step)) == []


def test_delta_updates_through_weightsyncs_manager_send_only_the_changes(verl_auto_world: VerlWorld) -> None:
    """``engine_kwargs={"weightsync.auto": {"delta": True}}``: weightsync's drop-in manager keeps its epoch between
    verl's calls, so after a first full update each one sends the changes (8 bytes of every tensor per step), which
    the rollout's server adapter receives as whole tensors, bit-exact."""
    world = verl_auto_world
    kwargs = {**world.config.engine_kwargs["weightsync.auto"], "delta": True}
    config = dataclasses.replace(world.config, engine_kwargs={"weightsync.auto": kwargs})
    manager = CheckpointEngineManager(config=config, actor_wg=world.actor_wg, replicas=world.replicas)
    for step in range(STEPPED, STEPPED + 3):
        world.set_model(step)
        metrics = manager.update_weights(step)
        report = manager.last_report
        assert report is not None and report.ok
        assert [outcome.received for outcome in report.replicas] == ["full" if step == STEPPED else "changes"]
        if step > STEPPED:
            assert 0 < metrics["weightsync/wire_bytes"] < 0.01 * metrics["weightsync/bytes"], metrics
        for tensors, _ in world.received():
            assert mismatches(tensors, model_weights(step)) == []


def test_verls_own_manager_is_told_to_name_a_backend(verl_auto_world: VerlWorld) -> None:
    manager = VerlManager(config=verl_auto_world.config, actor_wg=verl_auto_world.actor_wg,
                          replicas=verl_auto_world.replicas)
    with pytest.raises(Exception, match="weightsync.auto picks its backend"):
        manager.update_weights(1)
