"""The typed plan (``weightsync.core.transports.plan``): what ``build_topology`` hands each rank round-trips through
plain data unchanged, and a malformed one is a ``TopologyError`` naming the field, at ``init_process_group``, before
any connection is made."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.api.errors import TopologyError
from weightsync.api.topology import epoch_of, with_epoch
from weightsync.api.types import Topology, WorkerContext
from weightsync.core.transports.chain.plan import ChainPlans, ChainReceive, ChainSend, Route, Source, Stripe
from weightsync.core.transports.collective.group import GroupPlans, GroupSend
from weightsync.core.transports.place import PingAnswer, Place, ping_answer
from weightsync.core.transports.plan import Idle, decode_metadata, decode_plan, encode_plan, with_delta_base
from weightsync.tcp.engine import TcpCheckpointEngine

SOURCE = Source(upstream="10.0.0.1:7000", upstream_position=0, children=(2,), in_place=(2,), peer="actor rank 0",
                route=Route(rail=1, hosts=("a", "b")))


@pytest.mark.parametrize("plan", [
    Idle(epoch="e"),
    ChainSend(epoch="e", children=(1, 2), stripe=Stripe(1, 2), sender=3),
    ChainReceive(epoch="e", rank=4, source=SOURCE, stripe=Stripe(0, 2)),
])
def test_a_plan_round_trips_through_plain_data(plan: Any) -> None:
    encoded = encode_plan(plan)
    assert isinstance(encoded, dict) and encoded["kind"] == type(plan).__struct_config__.tag
    assert decode_plan(encoded, ChainPlans, who="t") == plan


def test_epoch_and_delta_base_are_stamped_on_the_plain_data() -> None:
    topology = with_epoch(Topology(actor=[encode_plan(ChainSend()), encode_plan(Idle())],
                                   rollout=[encode_plan(ChainReceive(rank=0, source=SOURCE))]))
    token = epoch_of(topology.actor[0])
    assert len(token) == 32 and {epoch_of(args) for args in [*topology.actor, *topology.rollout]} == {token}
    sender = decode_plan(with_delta_base(topology.actor[0], 7), ChainPlans, who="t")
    assert (sender.epoch, sender.delta_base, sender.role, sender.striping) == (token, 7, "sender", (0, 1))
    assert epoch_of({}) == "" and epoch_of({"epoch": 3}) == ""


@pytest.mark.parametrize(("rank_args", "field"), [
    ({"kind": "chain-receive", "epoch": "e", "rank": 0, "source": {"upstream": "x:1", "upstream_position": "0"}},
     "$.source.upstream_position"),
    ({"kind": "chain-receive", "epoch": "e", "source": {"upstream": "x:1", "upstream_position": 0}}, "$.rank"),
    ({"kind": "chain-receive", "epoch": "e", "rank": 0, "source": {"upstream": "x:1"}}, "$.source.upstream_position"),
    ({"kind": "chain-send", "epoch": "e", "stripe": [2, 2]}, "$.stripe"),
    ({"kind": "chain-send", "epoch": "e", "children": [1], "fanout": 2}, "$.fanout"),
    ({"kind": "group-send", "epoch": "e"}, "$.kind"),
    ({"role": "sender", "epoch": "e", "children": [1]}, "$.kind"),
])
def test_a_malformed_plan_is_a_topology_error_naming_the_field(rank_args: dict[str, Any], field: str) -> None:
    with pytest.raises(TopologyError) as raised:
        decode_plan(rank_args, ChainPlans, who="tcp rollout rank 0")
    assert raised.value.details["field"] == field and "tcp rollout rank 0: malformed rank_args" in str(raised.value)


def test_each_transport_takes_only_its_own_plans() -> None:
    group = encode_plan(GroupSend(store_host="h", store_port=1, group_rank=0, group_size=2))
    assert isinstance(decode_plan(group, GroupPlans, who="t"), GroupSend)
    with pytest.raises(TopologyError, match="malformed rank_args"):
        decode_plan(group, ChainPlans, who="t")  # a chain rank handed a collective's plan


def test_the_engine_refuses_a_malformed_plan_before_connecting() -> None:
    engine = TcpCheckpointEngine(bucket_bytes=1 << 16, timeout=5.0,
                                 context=WorkerContext(role="rollout", rank=0, node_id="n"))
    try:
        engine.prepare()
        with pytest.raises(TopologyError) as raised:
            engine.init_process_group(rank_args={"kind": "chain-receive", "epoch": "e", "rank": "zero",
                                                 "source": {"upstream": "127.0.0.1:9", "upstream_position": 0}})
        assert raised.value.details["field"] == "$.rank" and engine.role is None
        with pytest.raises(TopologyError, match="no membership epoch"):
            engine.init_process_group(rank_args=encode_plan(Idle()))
    finally:
        engine.close()


def test_a_worker_s_place_decodes_from_its_metadata_and_its_ping() -> None:
    answer = decode_metadata(ping_answer(node_id="n", host_ip="127.0.0.1"), PingAnswer, who="w")
    assert (answer.node_id, answer.host_ip, answer.rail, answer.rails) == ("n", "127.0.0.1", 0, 1)
    assert decode_metadata({"node_id": "n", "hostname": "h", "host_ip": "1.2.3.4", "other": [1]}, Place,
                           who="w").host == "h (1.2.3.4)"
    with pytest.raises(TopologyError) as raised:
        decode_metadata({"node_id": "n", "rail": "one"}, Place, who="rollout rank 3")
    assert raised.value.details["field"] == "$.rail" and "rollout rank 3: malformed metadata" in str(raised.value)
