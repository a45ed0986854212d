"""actor_wg / actor_wg_world_size are keyword-only at every definition (except the two documented exemptions)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
import pkgutil
from collections.abc import Iterator
from typing import Any

import pytest

import weightsync
from weightsync.api.errors import RenamedKeywordError
from weightsync.api.registry import get_backend_spec, installed_backends
from weightsync.api.types import WorldMetadata

ROOT = pathlib.Path(__file__).resolve().parents[2]

KEYWORDS = {"actor_wg", "actor_wg_world_size"}
EXEMPT = {
    # A wrapper constructor whose only argument is the object it wraps (positional-only).
    "weightsync.verl.groups.VerlActorWorkerGroup.__init__(actor_wg)",
    # The verl-ABC shim: verl's own manager calls build_topology positionally.
    "weightsync.verl.engine.VerlCheckpointEngine.build_topology(actor_wg_world_size)",
}
# weightsync.verl is walked where verl is installed (the `verl` hatch env runs this module too).
VERL = importlib.util.find_spec("verl") is not None and importlib.util.find_spec("weightsync.verl") is not None


def _modules() -> Iterator[Any]:
    for info in pkgutil.walk_packages(weightsync.__path__, "weightsync."):
        if info.name.startswith(("weightsync.migrate", "weightsync.api.testing")) or info.name.endswith("__main__"):
            continue
        yield importlib.import_module(info.name)


def _callables(module: Any) -> Iterator[tuple[str, Any]]:
    for name, value in vars(module).items():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            yield f"{module.__name__}.{name}", value
        elif inspect.isclass(value):
            for attribute, member in vars(value).items():
                function = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if inspect.isfunction(function):
                    yield f"{module.__name__}.{name}.{attribute}", function


def _sites() -> dict[str, inspect._ParameterKind]:
    sites = {}
    for module in _modules():
        for qualname, function in _callables(module):
            for parameter in inspect.signature(function).parameters.values():
                if parameter.name in KEYWORDS:
                    sites[f"{qualname}({parameter.name})"] = parameter.kind
    return sites


def test_every_definition_takes_actor_wg_keyword_only() -> None:
    sites = _sites()
    expected = {
        "weightsync.core.control.manager.CheckpointEngineManager.__init__(actor_wg)",
        "weightsync.core.worker.engine.BucketCheckpointEngine.build_topology(actor_wg_world_size)",
        # A backend's topology lives on its transport (the engine class delegates to it).
        "weightsync.core.transports.transport.Transport.build_topology(actor_wg_world_size)",
        "weightsync.core.transports.collective.group.GroupTransport.build_topology(actor_wg_world_size)",
        "weightsync.shm.engine.ShmTransport.build_topology(actor_wg_world_size)",
        "weightsync.api.protocols.CheckpointEngine.build_topology(actor_wg_world_size)",
        "weightsync.api.topology.build_checked_topology(actor_wg_world_size)",
    }
    if VERL:
        expected |= {"weightsync.verl.manager.CheckpointEngineManager.__init__(actor_wg)", *EXEMPT}
    assert expected <= set(sites), sorted(set(expected) - set(sites))
    positional = [site for site, kind in sites.items() if kind is not inspect.Parameter.KEYWORD_ONLY
                  and site not in EXEMPT]
    assert positional == []


def test_each_exemption_is_still_one_of_the_two_documented_shapes() -> None:
    if not VERL:
        pytest.skip("the exempt definitions live in weightsync.verl (run in the verl env: hatch run verl:test)")
    sites = _sites()
    # Still positional (else the exemption is stale): the wrapper's only argument is positional-only.
    assert sites["weightsync.verl.groups.VerlActorWorkerGroup.__init__(actor_wg)"] is inspect.Parameter.POSITIONAL_ONLY
    shim = "weightsync.verl.engine.VerlCheckpointEngine.build_topology(actor_wg_world_size)"
    assert sites[shim] is inspect.Parameter.POSITIONAL_OR_KEYWORD
    wrapper = importlib.import_module("weightsync.verl.groups").VerlActorWorkerGroup  # mypy.ini skips verl
    assert list(inspect.signature(wrapper.__init__).parameters) == ["self", "actor_wg"]


EXPECTED_BACKENDS = {"shm", "gloo", "tcp", "nixl", "mooncake", "nccl", "hccl", "kimi"}


def _installed(backend: str) -> bool:
    """Whether this environment installs backend's distribution (the verl env installs shm and gloo only)."""
    try:
        importlib.metadata.distribution(f"weightsync-{backend}")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


INSTALLED_BACKENDS = {name for name in EXPECTED_BACKENDS if _installed(name)}


def _engine_class(name: str) -> Any:
    """The engine class without the availability probe (a CUDA backend is still checked on a CPU machine)."""
    module, _, attribute = get_backend_spec(name).engine.partition(":")
    return getattr(importlib.import_module(module), attribute)


def test_every_registered_backend_is_checked() -> None:
    found = {name for name in installed_backends() if not name.startswith("test-")}
    assert found == INSTALLED_BACKENDS
    assert {"shm", "gloo"} <= found
    # The test env (hatch test) installs every backend; only the verl env installs a subset.
    assert VERL or found == EXPECTED_BACKENDS
    for name in found:
        parameter = inspect.signature(_engine_class(name).build_topology).parameters["actor_wg_world_size"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, name


def test_every_adapter_in_the_repository_is_walked() -> None:
    adapters = {path.parent.name for path in ROOT.glob("adapters/*/pyproject.toml")}
    walked = {module.__name__.split(".")[1] for module in _modules()}
    # An adapter whose heavy dependency is absent here (verl outside its env) cannot be imported, so it is not walked.
    importable = {name.removeprefix("weightsync-") for name in adapters
                  if importlib.util.find_spec(f"weightsync.{name.removeprefix('weightsync-')}") is not None}
    assert "ray" in importable
    assert importable <= walked
    assert VERL == ("verl" in walked)


@pytest.mark.parametrize("backend", sorted(EXPECTED_BACKENDS))
def test_old_keywords_and_positional_calls_get_a_helpful_type_error(backend: str) -> None:
    if backend not in INSTALLED_BACKENDS:
        pytest.skip(f"weightsync-{backend} is not installed in this env")
    engine = _engine_class(backend)
    metadata = WorldMetadata(actor=[], rollout=[])
    old_style: dict[str, Any] = {"trainer_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
    with pytest.raises(RenamedKeywordError, match="actor_wg_world_size=.*weightsync migrate"):
        engine.build_topology(**old_style)
    with pytest.raises(TypeError, match="keyword arguments only"):
        engine.build_topology(1, 1, metadata)


def test_the_walk_would_catch_a_positional_definition() -> None:
    # Negative control: the same inspection flags a positional-or-keyword actor_wg.
    def loose(actor_wg: object, replicas: object) -> None: ...

    kind = inspect.signature(loose).parameters["actor_wg"].kind
    assert kind is not inspect.Parameter.KEYWORD_ONLY
