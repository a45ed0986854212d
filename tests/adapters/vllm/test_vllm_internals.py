"""``weightsync.vllm.internals`` against the installed vLLM, in this process: the probe, and each internal's
function on vLLM's own code (the factory, the layerwise reload on a small module, the MTP check), used and forced
absent. What needs a running engine (the keep-mode pause, loads into vLLM's model, the reload's timing) is proved
through the fallbacks on real engines in ``test_vllm_updates``."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Any, get_args

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in the vllm env: python3 -m hatch run vllm:test")

import torch  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402
from vllm.model_executor.model_loader import reload as vllm_reload  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402

from weightsync.api.errors import ConfigError  # noqa: E402
from weightsync.vllm import internals  # noqa: E402

NAMES: tuple[internals.InternalName, ...] = get_args(internals.InternalName)


@pytest.fixture
def reprobe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Probe again (``importlib.reload``) after the test changed vLLM or the environment; again once it is undone."""
    yield lambda: importlib.reload(internals)
    monkeypatch.undo()
    importlib.reload(internals)


@pytest.fixture
def avoided() -> Iterator[Any]:
    """``internals.avoid`` for one test; every internal used again after it."""
    yield internals.avoid
    internals.avoid([])


def test_the_probe_finds_every_internal_in_the_installed_vllm(avoided: Any) -> None:
    import vllm

    assert internals.VLLM_VERSION == vllm.__version__
    assert internals.report() == {name: "used" for name in NAMES}
    assert internals.notes(*NAMES) == []
    avoided(["layer_progress"])  # control: what an absent internal reports
    [note] = internals.notes(*NAMES)
    assert note.startswith(f"vLLM {vllm.__version__}: ") and "missing-layer check is skipped" in note, note
    assert [name for name, status in internals.report().items() if status != "used"] == ["layer_progress"]
    with pytest.raises(ConfigError, match="unknown vLLM internal"):
        internals.avoid(["layerwise"])


def test_the_probe_sees_a_vllm_that_changed(monkeypatch: pytest.MonkeyPatch, reprobe: Any) -> None:
    """What the probe reads is vLLM's: a ``pause_generation`` that no longer delegates to ``pause_scheduler_async``,
    a layerwise reload without ``LAYERWISE_INFO``, and the avoid list in the environment."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.engine.async_llm import AsyncLLM

    async def pause_generation(self: Any, *, mode: str = "abort", clear_cache: bool = True) -> None:
        return None

    monkeypatch.setattr(AsyncLLM, "pause_generation", pause_generation)
    monkeypatch.delattr(layerwise, "LAYERWISE_INFO")
    monkeypatch.setenv(internals.AVOID_ENV, "mtp_check")
    reprobe()
    report = internals.report()
    assert "no longer what pause_generation calls" in report["pause_scheduler"], report
    assert "ImportError" in report["held_arguments"] and "ImportError" in report["layer_progress"], report
    assert "avoided" in report["mtp_check"], report
    assert {name for name, status in report.items() if status == "used"} == {"engine_registry", "load_weights_hook"}


@pytest.mark.parametrize("registry", ["used", "avoided"])
def test_register_engine_leaves_a_registered_name_alone(monkeypatch: pytest.MonkeyPatch, avoided: Any,
                                                        registry: str) -> None:
    """Registered twice, as vLLM's plugin loading does: the second call changes nothing, whether the registry is read
    or its duplicate-name error caught (the fallback); any other error of ``register_engine`` still raises."""
    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", dict(WeightTransferEngineFactory._registry))
    avoided(["engine_registry"] if registry == "avoided" else [])
    assert internals.register_engine("weightsync-test", "weightsync.vllm.engine", "WeightsyncTransferEngine")
    loader = WeightTransferEngineFactory._registry["weightsync-test"]
    assert not internals.register_engine("weightsync-test", "weightsync.vllm.engine", "WeightsyncTransferEngine")
    assert WeightTransferEngineFactory._registry["weightsync-test"] is loader
    assert loader().__name__ == "WeightsyncTransferEngine"

    def other_error(cls: Any, name: str, *args: Any) -> None:
        raise ValueError("Weight transfer engine 'nccl' is already registered.")  # another name's

    monkeypatch.setattr(WeightTransferEngineFactory, "register_engine", classmethod(other_error))
    with pytest.raises(ValueError, match="'nccl'"):
        internals.register_engine("weightsync-other", "weightsync.vllm.engine", "WeightsyncTransferEngine")


# -- the layerwise reload, vLLM's own, on a small module ---------------------------------------------------------


class _Pair(torch.nn.Module):
    """Two layers and the loader shape of a vLLM model: ``load_weights`` hands each tensor to its parameter's
    ``weight_loader`` (the layerwise reload wraps those)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4, bias=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        parameters = dict(self.named_parameters())
        for name, tensor in weights:
            parameter = parameters[name]
            getattr(parameter, "weight_loader", default_weight_loader)(parameter, tensor)
        return set(parameters)


class _Config:
    dtype = torch.float32


def _reload(model: _Pair, batches: list[list[tuple[str, torch.Tensor]]], *, copy_held: bool,
            kept: dict[tuple[int, int, str], torch.Tensor]) -> list[str] | None:
    """One layerwise reload of ``batches``, each batch's views overwritten once the next is asked for (as
    weightsync's receive buffers are); what ``missing_layers`` said before the finalize."""
    vllm_reload.initialize_layerwise_reload(model)
    for batch in batches:
        model.load_weights(batch)
        if copy_held:
            internals.copy_held(batch, kept)
        for _, view in batch:
            view.fill_(-1.0)
    missing = internals.missing_layers(model)
    vllm_reload.finalize_layerwise_reload(model, _Config())
    return missing


@pytest.fixture
def pair() -> _Pair:
    model = _Pair()
    vllm_reload.record_metadata_for_reloading(model)
    return model


def test_copy_held_replaces_what_the_reload_holds_of_a_view(pair: _Pair) -> None:
    """``first.weight`` arrives a batch before ``first.bias``: the reload holds its view until the layer is whole.
    Copied, the layer gets the weight sent; not copied (the control), what the buffer held next; the copy goes
    into the buffer kept from the last reload."""
    kept: dict[tuple[int, int, str], torch.Tensor] = {}
    buffers = []
    for copy_held in (True, False, True):
        weight, bias, second = torch.full((4, 4), 2.0), torch.full((4,), 3.0), torch.full((4, 4), 4.0)
        _reload(pair, [[("first.weight", weight)], [("first.bias", bias), ("second.weight", second)]],
                copy_held=copy_held, kept=kept)
        expected = 2.0 if copy_held else -1.0
        assert torch.equal(pair.first.weight, torch.full((4, 4), expected)), (copy_held, pair.first.weight)
        assert torch.equal(pair.first.bias, torch.full((4,), 3.0))
        assert torch.equal(pair.second.weight, torch.full((4, 4), 4.0))
        buffers.append(list(kept.values()))
    assert len(buffers[0]) == 1 and buffers[2][0] is buffers[0][0]  # one copy, into the same buffer each time


def test_missing_layers_names_a_layer_that_got_nothing(pair: _Pair, avoided: Any) -> None:
    kept: dict[tuple[int, int, str], torch.Tensor] = {}
    whole = [("first.weight", torch.ones(4, 4)), ("first.bias", torch.ones(4)), ("second.weight", torch.ones(4, 4))]
    assert _reload(pair, [whole], copy_held=False, kept=kept) == []
    assert _reload(pair, [whole[:2]], copy_held=False, kept=kept) == ["second"]
    avoided(["layer_progress"])
    assert _reload(pair, [whole[:2]], copy_held=False, kept=kept) is None  # skipped: no fallback exists


def test_observe_load_weights_sees_every_tensor_and_leaves_the_model_as_it_was(pair: _Pair, avoided: Any) -> None:
    seen: list[str] = []

    def record(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            seen.append(name)
            yield name, tensor

    with internals.observe_load_weights(pair, record) as observing:
        loaded = pair.load_weights([("second.weight", torch.full((4, 4), 5.0))])
    assert observing and seen == ["second.weight"] and loaded == {"first.weight", "first.bias", "second.weight"}
    assert torch.equal(pair.second.weight, torch.full((4, 4), 5.0))
    assert "load_weights" not in vars(pair)
    avoided(["load_weights_hook"])
    with internals.observe_load_weights(pair, record) as observing:
        pair.load_weights([("second.weight", torch.ones(4, 4))])
    assert not observing and seen == ["second.weight"] and "load_weights" not in vars(pair)


def test_mtp_check_disabled_is_vllms_own(avoided: Any) -> None:
    from vllm.model_executor.model_loader.mtp_validation import is_mtp_completeness_check_enabled

    with internals.mtp_check_disabled():
        assert not is_mtp_completeness_check_enabled()
    assert is_mtp_completeness_check_enabled()
    avoided(["mtp_check"])
    with internals.mtp_check_disabled():  # the fallback: nothing to disable
        assert is_mtp_completeness_check_enabled()
