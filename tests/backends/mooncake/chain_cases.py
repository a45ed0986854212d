"""The chain acceptance tests, written once and run by the nixl and mooncake test modules over their probes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.backends.mooncake.chain_world import (
    MODEL_BYTES,
    ChainWorld,
    bytes_read_from,
    check_bit_exact,
    check_sender_sent_one_model,
    reads_delta,
)


class ChainCases:
    """Subclasses provide a module-scoped ``world`` fixture (a ``ChainWorld`` with three replicas)."""

    def test_sender_egress_is_one_model_for_three_receivers(self, world: ChainWorld) -> None:
        manager = world.manager()
        expected = world.set_version(101)
        before = world.receiver_logs()
        report = world.update(manager, 101)
        check_bit_exact(world.digests(), expected)
        assert report.nbytes == MODEL_BYTES
        delta = reads_delta(before, world.receiver_logs())
        per_receiver = [sum(log["reads"].values()) for log in delta]
        sender_bytes = bytes_read_from(delta, world.sender_identity())
        check_sender_sent_one_model(sender_bytes=sender_bytes, per_receiver=per_receiver, model_bytes=MODEL_BYTES)

        # Negative control: the same check over a star (fan-out 3: every receiver reads from the sender) must fail,
        # with the sender's egress three models.
        star = world.manager(fanout=3)
        expected = world.set_version(102)
        before = world.receiver_logs()
        world.update(star, 102)
        check_bit_exact(world.digests(), expected)
        delta = reads_delta(before, world.receiver_logs())
        star_bytes = bytes_read_from(delta, world.sender_identity())
        assert star_bytes == 3 * MODEL_BYTES
        with pytest.raises(AssertionError, match="the sender sent"):
            check_sender_sent_one_model(sender_bytes=star_bytes, per_receiver=[MODEL_BYTES] * 3,
                                        model_bytes=MODEL_BYTES)

    def test_second_update_registers_no_memory(self, world: ChainWorld) -> None:
        manager = world.manager(bucket_bytes=128 * 1024)
        world.set_version(111)
        world.update(manager, 111)
        first = [log["registrations"] for log in world.all_logs()]
        expected = world.set_version(112)
        report = world.update(manager, 112)
        assert not report.rebuilt
        check_bit_exact(world.digests(), expected)
        logs = world.all_logs()
        assert [log["registrations"] for log in logs] == first
        # Positive control: one ring per serving process was registered (the wrapper sees registrations), and
        # rank 1 of the actor worker group, which only drains, registered nothing for this engine.
        assert all(count >= 1 for index, count in enumerate(first) if index != 1)
        # Negative control: a different bucket size makes every host build a new engine: the old rings are
        # deregistered and new ones registered, and the counter notices.
        deregistered = [log["deregistrations"] for log in logs]
        other = world.manager(bucket_bytes=192 * 1024)
        expected = world.set_version(113)
        world.update(other, 113)
        check_bit_exact(world.digests(), expected)
        after = world.all_logs()
        assert [log["registrations"] for log in after] != first
        grown = [new["deregistrations"] - old for new, old in zip(after, deregistered)]
        assert grown[0] == 1 and grown[2:] == [1] * len(world.replicas)

    def test_replica_added_between_updates_ends_bit_exact(self, world: ChainWorld) -> None:
        manager = world.manager()
        world.set_version(121)
        world.update(manager, 121)
        late = world.add_replica()
        manager.add_replicas([late])
        # Negative control of the check: before its first update the late replica does not hold the weights.
        expected = world.set_version(122)
        with pytest.raises(AssertionError, match="rollout ranks"):
            check_bit_exact(world.digests([late]), expected)
        before = world.receiver_logs()
        report = world.update(manager, 122)
        assert report.rebuilt and report.receivers == 4
        check_bit_exact(world.digests(), expected)
        delta = reads_delta(before, world.receiver_logs())
        assert sum(delta[-1]["reads"].values()) == MODEL_BYTES  # the full model, not a difference
        sender_bytes = bytes_read_from(delta, world.sender_identity())
        check_sender_sent_one_model(sender_bytes=sender_bytes, per_receiver=[sum(d["reads"].values()) for d in delta],
                                    model_bytes=MODEL_BYTES)
        # And a replica removed: the chain is rebuilt around the gap.
        gone = world.replicas.pop(1)
        manager.remove_replicas([gone])
        expected = world.set_version(123)
        report = world.update(manager, 123)
        assert report.rebuilt and report.receivers == 3
        check_bit_exact(world.digests(), expected)
        gone.shutdown()

    def test_keyword_only_and_options(self, world: ChainWorld) -> None:
        from weightsync.api.errors import ConfigError
        from weightsync.api.registry import load_engine_class

        engine_class: Any = load_engine_class(world.backend)
        with pytest.raises(ConfigError, match="fanout"):
            engine_class(bucket_bytes=1 << 20, fanout=0)
        with pytest.raises(ConfigError, match="unknown options"):
            engine_class(bucket_bytes=1 << 20, fan_out=2)
