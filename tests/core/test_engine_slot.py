"""``EngineSlot``: a worker's next engine takes over what the last one held across updates (a delta receiver's
version) when only its rank, its transport or whether updates are staged changed — a replica before it left;
``auto`` picked another backend for the catch-up epoch (unstaged) than for the update's — and not when how updates
are made changed."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.api.config import SyncConfig
from weightsync.core.worker.host import EngineSlot, engine_spec


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.state, self.closed = spec, object(), False

    def held(self) -> object:
        return self.state

    def adopt_held(self, held: object) -> None:
        self.state = held

    def close(self) -> None:
        self.closed = True


def spec(backend: str = "shm", rank: int = 0, **config: Any) -> dict[str, Any]:
    return engine_spec(backend=backend, config=SyncConfig(delta=True, **config), role="rollout", rank=rank)


@pytest.mark.parametrize(("after", "carried"), [
    (spec(rank=2), True),
    (spec(backend="tcp"), True),
    (spec(backend_options={"transport_hook": "x:y"}), True),
    (spec(staged=True), True),  # a staged update's swap reaches the same delta receiver
    (spec(bucket_bytes=1 << 20), False),
    (spec(verify_every=2), False),
    (engine_spec(backend="shm", config=SyncConfig(delta=True), role="actor", rank=0), False),
])
def test_what_a_worker_held_carries_over_only_when_rank_transport_or_staging_changed(after: dict[str, Any],
                                                                                     carried: bool) -> None:
    slot = EngineSlot(Engine)  # type: ignore[arg-type]
    first: Any = slot.ensure(spec())
    again: Any = slot.ensure(spec())
    assert again is first  # the same spec: the same engine
    second: Any = slot.ensure(after)
    assert second is not first and first.closed
    assert (second.state is first.state) is carried
