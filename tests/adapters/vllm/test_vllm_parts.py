"""A worker's part recorded from its model's own loaders (``weightsync.vllm.parts``), on a small model with vLLM's
loader shape — column- and row-parallel slices, a fused parameter fed from two checkpoint tensors, a loader that
computes on its tensor, one that gathers rows that are not a box — in vLLM's loadable form
(``internals.loadable``), and the model left exactly as it was. The real vLLM model is recorded in
``test_vllm_workers.py``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in the vllm env: python3 -m hatch run vllm:test")

import torch  # noqa: E402
from vllm.model_executor.model_loader import reload as vllm_reload  # noqa: E402

from weightsync.api.parts import Region  # noqa: E402
from weightsync.vllm import internals  # noqa: E402
from weightsync.vllm.parts import box_of, record_part  # noqa: E402

SHAPES = {"up.weight": ((8, 4), torch.float32), "down.weight": ((4, 8), torch.float32),
          "q.weight": ((4, 4), torch.float32), "k.weight": ((4, 4), torch.float32),
          "scale.weight": ((4,), torch.float32), "rows.weight": ((6, 4), torch.float32)}


class _Sharded(torch.nn.Module):
    """Rank ``rank`` of 2 of a tensor-parallel model: its parameters hold its slices; each parameter's
    ``weight_loader`` takes its slice of the checkpoint tensor as vLLM's loaders do."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.up = torch.nn.Linear(4, 4, bias=False)      # column-parallel: rows rank*4 .. of (8, 4)
        self.down = torch.nn.Linear(4, 4, bias=False)    # row-parallel: columns rank*4 .. of (4, 8)
        self.qk = torch.nn.Linear(4, 4, bias=False)      # fused: q rows then k rows, 2 of each per rank
        self.scale = torch.nn.Linear(4, 1, bias=False)   # computes on its tensor: not a move
        self.rows = torch.nn.Linear(4, 2, bias=False)    # takes rows 0 and 2+rank*3: not a box
        self.up.weight.weight_loader = self._narrow(0)  # type: ignore[attr-defined]
        self.down.weight.weight_loader = self._narrow(1)  # type: ignore[attr-defined]
        self.qk.weight.weight_loader = self._fused  # type: ignore[attr-defined]
        self.scale.weight.weight_loader = self._scaled  # type: ignore[attr-defined]
        self.rows.weight.weight_loader = self._rows  # type: ignore[attr-defined]

    def _narrow(self, dim: int) -> Any:
        def load(param: torch.Tensor, loaded: torch.Tensor) -> None:
            size = param.shape[dim]
            param.data.copy_(loaded.narrow(dim, self.rank * size, size))
        return load

    def _fused(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        place = param.data.narrow(0, 0 if shard == "q" else 2, 2)
        place.copy_(loaded.chunk(2, 0)[self.rank])

    def _scaled(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_((loaded * 2).unsqueeze(0))

    def _rows(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[torch.tensor([0, 2 + self.rank * 3])])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, tensor in weights:
            if name in ("q.weight", "k.weight"):
                self.qk.weight.weight_loader(self.qk.weight, tensor, name[0])  # type: ignore[attr-defined]
            else:
                param = getattr(self, name.split(".")[0]).weight
                param.weight_loader(param, tensor)
        return {name for name, _ in self.named_parameters()}


@pytest.fixture
def avoided() -> Iterator[Any]:
    yield internals.avoid
    internals.avoid([])


@pytest.mark.parametrize("rank", [0, 1])
def test_the_recorded_part_is_what_the_loaders_take_and_the_model_is_left_as_it_was(rank: int) -> None:
    model = _Sharded(rank)
    vllm_reload.record_metadata_for_reloading(model)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    with internals.loadable(model) as recording:
        assert recording
        part = record_part(model, SHAPES)
    assert part.tensors == {
        "up.weight": (Region(start=(rank * 4, 0), size=(4, 4)),),
        "down.weight": (Region(start=(0, rank * 4), size=(4, 4)),),
        "q.weight": (Region(start=(rank * 2, 0), size=(2, 4)),),
        "k.weight": (Region(start=(rank * 2, 0), size=(2, 4)),),
    }
    # A loader that computes on its tensor, or gathers what is not a box, keeps it whole (and says so).
    assert part.fallbacks == ("rows.weight", "scale.weight") and "scale.weight" not in part.tensors
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in before)  # nothing written, every tensor back
    model.load_weights([("up.weight", torch.arange(32.0).reshape(8, 4))])  # its own loaders again
    assert torch.equal(model.up.weight, torch.arange(32.0).reshape(8, 4)[rank * 4:rank * 4 + 4])


def test_a_loader_that_reads_values_makes_the_recording_fail_as_a_whole() -> None:
    """``.item()`` needs the data: the recorder cannot go on (``Unrecordable``), and the worker declares no part
    rather than a wrong one (``WeightsyncTransferEngine._record_part``)."""
    from weightsync.vllm.parts import Unrecordable

    model = _Sharded(0)
    model.scale.weight.weight_loader = lambda param, loaded: param.data.fill_(loaded.sum().item())  # type: ignore
    vllm_reload.record_metadata_for_reloading(model)
    with internals.loadable(model), pytest.raises(Unrecordable, match="scale.weight"):
        record_part(model, {"scale.weight": SHAPES["scale.weight"]})


def test_without_the_internal_nothing_is_recorded_and_the_model_is_untouched(avoided: Any) -> None:
    model = _Sharded(1)
    vllm_reload.record_metadata_for_reloading(model)
    avoided(["loader_recording"])
    with internals.loadable(model) as recording:
        assert not recording
    assert not any(param.is_meta for param in model.parameters())


def test_box_of_tells_a_box_from_what_is_not_one() -> None:
    positions = torch.arange(24).reshape(4, 6)
    assert box_of(positions[1:3, 2:5], (4, 6)) == Region(start=(1, 2), size=(2, 3))
    assert box_of(positions[1:3, 2:5].t().contiguous(), (4, 6)) == Region(start=(1, 2), size=(2, 3))
    assert box_of(positions[[0, 2]], (4, 6)) is None  # rows 0 and 2: their span holds row 1 too
    assert box_of(torch.cat([positions[0], positions[0]]), (4, 6)) is None  # a row twice is not a box


def test_the_calls_of_one_step_meet_and_each_worker_gets_its_own_result() -> None:
    """``Rendezvous``: the last of a replica's workers to call runs the step once, with every worker's value; each
    gets its own entry (an error entry raised to that worker alone); a worker calling again before the others
    arrived starts the step anew, and the earlier callers are told; a call of another step ends an unfinished one
    (its callers told, nothing of it kept)."""
    import asyncio

    from weightsync.api.errors import LifecycleError
    from weightsync.vllm.actor import Rendezvous

    runs: list[list[Any]] = []

    async def run(values: list[Any]) -> list[Any]:
        runs.append(values)
        return [f"done {value}" if value != "bad" else ValueError("worker 1's own failure") for value in values]

    async def scenario() -> list[Any]:
        meet = Rendezvous(3)
        return list(await asyncio.gather(*(meet.join("init", worker, value, run)
                                           for worker, value in ((2, "c"), (0, "a"), (1, "bad"))),
                                         return_exceptions=True))

    first, second, third = asyncio.run(scenario())
    assert runs == [["a", "bad", "c"]] and first == "done c" and second == "done a"
    assert isinstance(third, ValueError)

    async def retried() -> list[Any]:
        meet = Rendezvous(2)
        early = asyncio.ensure_future(meet.join("prepare", 0, "old", run))
        await asyncio.sleep(0)
        again = asyncio.ensure_future(meet.join("prepare", 0, "new", run))
        await asyncio.sleep(0)
        other = await meet.join("prepare", 1, "b", run)
        return [await asyncio.gather(early, return_exceptions=True), await again, other]

    runs.clear()
    (early,), again, other = asyncio.run(retried())
    assert isinstance(early, LifecycleError) and again == "done new" and other == "done b"
    assert runs == [["new", "b"]]

    async def given_up() -> tuple[list[Any], dict[str, Any]]:
        """Worker 1 never called ``update 5`` (the manager gave up on it); the next step ends it for worker 0."""
        meet = Rendezvous(2)
        abandoned = asyncio.ensure_future(meet.join("update 5", 0, None, run))
        await asyncio.sleep(0)
        done = await asyncio.gather(meet.join("finalize", 0, "x", run), meet.join("finalize", 1, "y", run))
        ended = await asyncio.wait_for(asyncio.gather(abandoned, return_exceptions=True), 10)  # not left waiting
        return [ended, done], dict(meet._open)

    runs.clear()
    ([(abandoned,), done], left) = asyncio.run(given_up())
    assert isinstance(abandoned, LifecycleError) and "given up" in str(abandoned)
    assert done == ["done x", "done y"] and runs == [["x", "y"]] and left == {}
