"""mooncake over real Ray actors, observed through wrappers around Mooncake's TransferEngine in every worker process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.backends.mooncake.chain_cases import ChainCases
from tests.backends.mooncake.chain_world import ChainWorld, chain_world
from tests.backends.mooncake.io_probe import ProbedSink, ProbedSource
from tests.conftest import RayNodes


@pytest.fixture(scope="module")
def world(ray_nodes: RayNodes) -> Iterator[ChainWorld]:
    with chain_world(backend="mooncake", source=ProbedSource, sink=ProbedSink, node_id=ray_nodes.head,
                     replicas=3) as world:
        yield world


class TestMooncakeChain(ChainCases):
    pass
