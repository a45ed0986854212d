"""Every vLLM internal the adapter touches, one function each, probed once at import against the installed vLLM.

vLLM's public surface (``WeightTransferEngine``, ``AsyncLLM``, the worker's methods, ``initialize_layerwise_reload``
/ ``finalize_layerwise_reload``) carries the adapter; it reaches past it only here, each time for a reason. Importing
this module probes each internal in the installed vLLM and records whether it is present and usable
(:func:`probe`); a function whose internal is not usable takes the public fallback, or, where there is none, skips
what the internal was for, and the replica's notes say so (:func:`notes`, ``VllmRolloutReplica.notes``):

=====================  ===================================================  =======================================
internal               touches (what for)                                   when it is not usable
=====================  ===================================================  =======================================
``engine_registry``    ``WeightTransferEngineFactory._registry`` read       ``register_engine``, its duplicate-name
                       (a name registered twice: vLLM loads the plugin in   ``ValueError`` caught (that one only)
                       every process, possibly more than once)
``pause_scheduler``    ``AsyncLLM.engine_core.pause_scheduler_async``       ``pause_generation(mode="keep",
                       (``pause_generation`` less its closing 20 ms sleep)  clear_cache=False)``, sleep included
``held_arguments``     ``LAYERWISE_INFO[layer].loaded_weights``: the        every tensor copied before vLLM sees
                       ``BoundArguments`` the layerwise reload holds,       it (``copy="all"``)
                       replaced by copies (``copy="held"``)
``layer_progress``     ``LAYERWISE_INFO[layer].can_load()`` and             none: the missing-layer check is
                       ``.load_numel``, ``is_deferred_attention_layer``     skipped, and the update's notes say so
                       (the missing-layer check)
``load_weights_hook``  ``model.load_weights`` replaced on the instance      the reload timed whole: no split into
                       (vLLM's ``reload_weights`` calls it by attribute):   reading and loading (``read_seconds``
                       observe what vLLM's loader pulls                     0.0)
``mtp_check``          ``mtp_validation.disable_mtp_completeness_check``    none needed: a vLLM without it has no
                       (vLLM's own engines disable it for an update)        such check to disable
``loader_recording``   ``reload.layerwise._get_original_loader``,           no part is recorded: each worker
                       ``_place_kernel_tensors``, ``LAYERWISE_INFO[layer]   receives and verifies the whole model
                       .reset()``: the model in its loadable form with its  (``weightsync.vllm.parts``)
                       own loaders, then restored, to record a part
=====================  ===================================================  =======================================

The worker's model is its public ``get_model()`` and the engine is found through weightsync's own record of it
(``weightsync.vllm.engine.engine_in_process``): neither needs an internal.

``WEIGHTSYNC_VLLM_AVOID`` (comma-separated names from the table), read at import, or :func:`avoid` at run time,
makes the probe treat internals as absent in this process: for a vLLM build where one misbehaves, and for the
tests, which prove every fallback on a real engine. Probing imports vLLM's weight-transfer, layerwise-reload and
``AsyncLLM`` modules (about 0.6 s in a process that had not yet imported the layerwise reload).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

import torch

from weightsync.api.errors import ConfigError

__all__ = ["AVOID_ENV", "Internal", "InternalName", "VLLM_VERSION", "avoid", "copy_held", "loadable",
           "missing_layers", "mtp_check_disabled", "notes", "observe_load_weights", "pause_keeping", "probe",
           "register_engine", "report", "usable"]

log = logging.getLogger(__name__)

InternalName = Literal["engine_registry", "pause_scheduler", "held_arguments", "layer_progress", "load_weights_hook",
                       "mtp_check", "loader_recording"]
AVOID_ENV = "WEIGHTSYNC_VLLM_AVOID"


@dataclass(frozen=True)
class Internal:
    """One vLLM internal as the probe found it in the installed vLLM."""

    name: InternalName
    touches: str
    """The vLLM names it reads, calls or changes."""
    instead: str
    """What the adapter does when it is not usable: the public fallback, or what is skipped."""
    missing: str = ""
    """Why it is not usable here; empty when it is."""

    @property
    def usable(self) -> bool:
        return not self.missing

    def note(self) -> str:
        """The message a replica reports when it went without this internal (empty when usable)."""
        if self.usable:
            return ""
        return f"vLLM {VLLM_VERSION}: {self.touches} {self.missing}; instead {self.instead}"


# -- the probe ----------------------------------------------------------------------------------------------------


def _version() -> str:
    try:
        import vllm
    except ImportError:
        return "(not installed)"
    return str(vllm.__version__)


def _reloading_info_fields() -> dict[str, Any]:
    """The fields and methods of what ``LAYERWISE_INFO`` holds per layer (``LayerReloadingInfo``), by name."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    if not isinstance(LAYERWISE_INFO, MutableMapping):
        raise TypeError(f"LAYERWISE_INFO is a {type(LAYERWISE_INFO).__name__}, not a mapping")
    return {**{name: getattr(LayerReloadingInfo, name) for name in dir(LayerReloadingInfo)},
            **{item.name: item for item in fields(LayerReloadingInfo)}}


def _probe_registry() -> str:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry = vars(WeightTransferEngineFactory).get("_registry")
    return "" if isinstance(registry, dict) else "is not a dict"


def _probe_pause() -> str:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient

    if not callable(getattr(AsyncMPClient, "pause_scheduler_async", None)):  # the client AsyncLLM makes
        return "is missing"
    # Calling it directly is what pause_generation does (with clear_cache=False) only while it delegates to it.
    if "pause_scheduler_async" not in AsyncLLM.pause_generation.__code__.co_names:
        return "is no longer what pause_generation calls"
    return ""


def _probe_held() -> str:
    loaded = _reloading_info_fields().get("loaded_weights")
    return "" if "BoundArguments" in str(getattr(loaded, "type", "")) else "holds no BoundArguments"


def _probe_progress() -> str:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    found = _reloading_info_fields()
    lacking = [name for name, present in (("can_load()", callable(found.get("can_load"))),
                                          ("load_numel", "load_numel" in found),
                                          ("is_deferred_attention_layer", callable(is_deferred_attention_layer)))
               if not present]
    return f"lacks {', '.join(lacking)}" if lacking else ""


def _probe_hook() -> str:
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    return "" if "load_weights" in reload_weights.__code__.co_names else "is no longer what reload_weights calls"


def _probe_mtp() -> str:
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    return "" if callable(disable_mtp_completeness_check) else "is not callable"


def _probe_recording() -> str:
    from vllm.model_executor.model_loader.reload import layerwise

    lacking = [name for name in ("_get_original_loader", "_place_kernel_tensors", "initialize_layerwise_reload")
               if not callable(getattr(layerwise, name, None))]
    if not callable(_reloading_info_fields().get("reset")):
        lacking.append("LayerReloadingInfo.reset")
    return f"lacks {', '.join(lacking)}" if lacking else ""


_INTERNALS: dict[InternalName, tuple[str, str, Callable[[], str]]] = {
    "engine_registry": ("WeightTransferEngineFactory._registry",
                        "register_engine, its duplicate-name ValueError caught", _probe_registry),
    "pause_scheduler": ("AsyncLLM.engine_core.pause_scheduler_async",
                        "pause_generation(mode='keep', clear_cache=False), with its 20 ms sleep", _probe_pause),
    "held_arguments": ("reload.layerwise.LAYERWISE_INFO[layer].loaded_weights (BoundArguments)",
                       "every tensor is copied before vLLM sees it (copy='all')", _probe_held),
    "layer_progress": ("reload.layerwise.LAYERWISE_INFO[layer].can_load/load_numel, is_deferred_attention_layer",
                       "the missing-layer check is skipped: a module the sender left out is not named",
                       _probe_progress),
    "load_weights_hook": ("model.load_weights replaced on the instance (reload.inplace.reload_weights)",
                          "the reload is timed whole (read_seconds 0.0)", _probe_hook),
    "mtp_check": ("model_loader.mtp_validation.disable_mtp_completeness_check",
                  "vLLM's MTP completeness check is left as it is", _probe_mtp),
    "loader_recording": ("reload.layerwise._get_original_loader, _place_kernel_tensors, LAYERWISE_INFO[layer].reset",
                         "no part is recorded: every worker receives and verifies the whole model",
                         _probe_recording),
}


def _run_probe(check: Callable[[], str]) -> str:
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - whatever the installed vLLM lacks, the reason is recorded
        return f"is missing ({type(exc).__name__}: {exc})"


def _found() -> dict[InternalName, Internal]:
    found = {name: Internal(name, touches, instead, _run_probe(check))
             for name, (touches, instead, check) in _INTERNALS.items()}
    for internal in found.values():
        if not internal.usable:
            log.warning("weightsync.vllm: %s", internal.note())
    return found


def _names(names: Iterable[str]) -> frozenset[InternalName]:
    known: tuple[InternalName, ...] = get_args(InternalName)
    given = set(names)
    if given - set(known):
        raise ConfigError(f"unknown vLLM internal(s) {sorted(given - set(known))}; known: {list(known)}")
    return frozenset(name for name in known if name in given)


VLLM_VERSION = _version()
_FOUND = _found()
_avoided = _names(name.strip() for name in os.environ.get(AVOID_ENV, "").split(",") if name.strip())


def avoid(names: Iterable[str]) -> None:
    """Treat these internals as absent in this process from now on (the others as the import's probe found them)."""
    global _avoided
    _avoided = _names(names)


def probe() -> Mapping[InternalName, Internal]:
    """Every internal as this process uses it: as found at import, less those avoided."""
    return {name: replace(internal, missing=internal.missing or "is avoided here (WEIGHTSYNC_VLLM_AVOID / avoid)")
            if name in _avoided else internal for name, internal in _FOUND.items()}


def usable(name: InternalName) -> bool:
    return probe()[name].usable


def notes(*names: InternalName) -> list[str]:
    """The notes of those of ``names`` that are not usable here (what a replica reports it went without)."""
    found = probe()
    return [found[name].note() for name in names if not found[name].usable]


def report() -> dict[str, str]:
    """Every internal as plain data: ``"used"`` or its note."""
    return {name: internal.note() or "used" for name, internal in probe().items()}


# -- one function per internal ------------------------------------------------------------------------------------


def register_engine(name: str, module_path: str, class_name: str) -> bool:
    """Register a weight-transfer engine by module path in ``WeightTransferEngineFactory``, a name already there
    left as it is; whether this call registered it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if usable("engine_registry"):
        if name in WeightTransferEngineFactory._registry:
            return False
        WeightTransferEngineFactory.register_engine(name, module_path, class_name)
        return True
    try:
        WeightTransferEngineFactory.register_engine(name, module_path, class_name)
    except ValueError as exc:  # vLLM's register_engine: "Weight transfer engine 'NAME' is already registered."
        if f"'{name}'" not in str(exc) or "already registered" not in str(exc):
            raise
        return False
    return True


async def pause_keeping(llm: Any) -> None:
    """``llm.pause_generation(mode="keep", clear_cache=False)`` without the 20 ms it then sleeps.

    ``AsyncLLM.pause_generation`` asks the engine core to pause its scheduler and then sleeps 20 ms so that the final
    outputs of requests the pause ends reach their callers before it returns — vLLM's comment calls it ordering,
    not correctness. A pause that keeps every request ends none, and the sleep would be a fifth of an update's
    fixed cost here, so the scheduler is paused directly (what ``pause_generation`` awaits; with
    ``clear_cache=False`` it does nothing else)."""
    if usable("pause_scheduler"):
        await llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    else:
        await llm.pause_generation(mode="keep", clear_cache=False)


def copy_held(batch: list[tuple[str, torch.Tensor]], kept: dict[tuple[int, int, str], torch.Tensor]) -> None:
    """Replace every tensor vLLM's layerwise reload still holds that shares memory with a view of ``batch`` with a
    copy of it (only where ``held_arguments`` is usable: the loader copies every tensor otherwise).

    On the CPU the copy goes into a buffer ``kept`` from the last update for the same place (the layer, the
    position among the tensors it holds, the argument) where it fits: a fresh allocation there costs page faults,
    about four times the copy (CUDA's caching allocator reuses its blocks the same way). Safe because every
    layer's held tensors are consumed by the end of the update that handed them over."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storages = {view.untyped_storage().data_ptr() for _, view in batch}
    for module, info in list(LAYERWISE_INFO.items()):
        for position, (_, bound) in enumerate(info.loaded_weights):
            for key, value in bound.arguments.items():
                if not isinstance(value, torch.Tensor) or value.untyped_storage().data_ptr() not in storages:
                    continue
                place = (id(module), position, key)
                buffer = kept.get(place)
                if (value.device.type != "cpu" or buffer is None or buffer.shape != value.shape
                        or buffer.dtype != value.dtype):
                    buffer = value.clone()
                    if value.device.type == "cpu":
                        kept[place] = buffer
                else:
                    buffer.copy_(value)
                bound.arguments[key] = buffer


def missing_layers(model: torch.nn.Module) -> list[str] | None:
    """Modules of ``model`` with parameters of their own that received nothing in the layerwise reload in progress
    (every update reaches every one: a delta update too gives vLLM whole tensors). Modules with buffers only
    (rotary caches) and attention layers, which vLLM finalizes after the reload, are not counted. None: the check
    is skipped (``layer_progress`` is not usable)."""
    if not usable("layer_progress"):
        return None
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    missing = []
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if (info is not None and info.can_load() and info.load_numel == 0
                and any(True for _ in module.parameters(recurse=False))
                and not is_deferred_attention_layer(module)):
            missing.append(name)
    return missing


@contextlib.contextmanager
def observe_load_weights(model: torch.nn.Module, wrap: Callable[[Iterable[Any]], Iterable[Any]]) -> Iterator[bool]:
    """Within the block, vLLM's loaders that call ``model.load_weights(weights, ...)`` (``reload_weights``) hand it
    ``wrap(weights)`` instead; it still reads and loads every tensor. Yields whether it does (``load_weights_hook``
    usable); when not, the model is left as it is."""
    if not usable("load_weights_hook"):
        yield False
        return
    vllm_model: Any = model  # a vLLM model's load_weights (torch.nn.Module has none)
    original: Callable[..., Any] = vllm_model.load_weights

    def load_weights(weights: Iterable[Any], *args: Any, **kwargs: Any) -> Any:
        return original(wrap(weights), *args, **kwargs)

    setattr(model, "load_weights", load_weights)
    try:
        yield True
    finally:
        delattr(model, "load_weights")


def mtp_check_disabled() -> contextlib.AbstractContextManager[Any]:
    """vLLM's own engines disable its multi-token-prediction completeness check while loading an update."""
    if not usable("mtp_check"):
        return contextlib.nullcontext()
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    return disable_mtp_completeness_check()  # type: ignore[no-any-return]


@contextlib.contextmanager
def loadable(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block, ``model`` is in vLLM's loadable form — the layerwise reload's parameters on the meta device,
    each with its own loader rather than the reload's wrapper — so that ``load_weights`` runs the loaders without
    loading anything (``weightsync.vllm.parts`` records a part so); afterwards every layer gets its own tensors back,
    untouched. Yields whether it could (``loader_recording`` usable); when not, the model is left as it is."""
    if not usable("loader_recording"):
        yield False
        return
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    vllm_model: Any = model
    layerwise.initialize_layerwise_reload(model)
    try:
        for layer in model.modules():
            for tensor in get_layer_tensors(layer).values():
                if hasattr(tensor, "weight_loader"):
                    tensor.weight_loader = layerwise._get_original_loader(tensor)
        yield True
    finally:
        for layer in model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
        if hasattr(vllm_model, "_original_do_torchao_reload"):
            vllm_model._do_torchao_reload = vllm_model._original_do_torchao_reload
