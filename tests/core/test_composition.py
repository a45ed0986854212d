"""Backends plug into core by composition: checked from outside, on the source and on the loaded classes."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import tomllib

import pytest

from weightsync.core.backend import BucketCheckpointEngine, Transport, engine_class

ROOT = pathlib.Path(__file__).resolve().parents[2]
BACKENDS = ("shm", "gloo", "tcp", "nixl", "mooncake", "nccl", "hccl", "kimi")
ENGINE_DATA = {"name", "devices", "option_names", "default_slots", "transport_class"}


def _sources(backend: str) -> list[pathlib.Path]:
    return sorted((ROOT / f"packages/weightsync-{backend}/src/weightsync/{backend}").glob("*.py"))


def _core_imports(path: pathlib.Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightsync.core"):
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names if alias.name.startswith("weightsync.core")}
    return modules


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_imports_one_module_of_core(backend: str) -> None:
    imported = set().union(*(_core_imports(path) for path in _sources(backend)))
    assert imported == {"weightsync.core.backend"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_backend_class_subclasses_the_pipeline_or_overrides_a_private_core_method(backend: str) -> None:
    for path in _sources(backend):
        try:
            module = importlib.import_module(f"weightsync.{backend}.{path.stem}")
        except ImportError as exc:  # a library missing here (the registry's probe says so): the source check holds
            pytest.skip(f"{path.stem}: {exc}")
        defined = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
        for name in defined:
            cls = getattr(module, name)
            core_bases = [base for base in cls.__mro__[1:] if base.__module__.startswith("weightsync.core")]
            assert not any("send_weights" in vars(base) for base in core_bases), f"{name} inherits the pipeline"
            private = {attr for attr in vars(cls) if attr.startswith("_") and not attr.startswith("__")
                       and attr != "_abc_impl"}
            for base in core_bases:
                assert not private & set(vars(base)), f"{name} overrides {private & set(vars(base))} of {base}"


@pytest.mark.parametrize("backend", ["shm", "gloo", "tcp", "nixl", "mooncake", "nccl", "hccl"])
def test_a_bucket_backend_engine_is_core_s_engine_with_a_transport_and_nothing_else(backend: str) -> None:
    try:
        engine = importlib.import_module(f"weightsync.{backend}.{'collective' if backend == 'gloo' else 'engine'}")
    except ImportError as exc:
        pytest.skip(str(exc))
    classes = [cls for _, cls in inspect.getmembers(engine, inspect.isclass)
               if issubclass(cls, BucketCheckpointEngine) and cls is not BucketCheckpointEngine]
    assert len(classes) == 1
    (cls,) = classes
    own = {attr for attr in vars(cls) if not attr.startswith("__")}
    assert own <= ENGINE_DATA and issubclass(cls.transport_class, Transport)
    assert cls.__bases__ == (BucketCheckpointEngine,)


def test_the_check_sees_an_engine_that_overrides_the_pipeline() -> None:
    # Negative control: a class that overrides a method is more than data, and the check above says so.
    class _Overriding(engine_class(importlib.import_module("weightsync.gloo.collective").GlooTransport)):  # type: ignore[misc]
        async def send_weights(self, weights: object, *, version: int = 0) -> None:
            return None

    assert {attr for attr in vars(_Overriding) if not attr.startswith("__")} - ENGINE_DATA == {"send_weights"}


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
def test_device_backends_depend_on_api_and_core_only(backend: str) -> None:
    project = tomllib.loads((ROOT / f"packages/weightsync-{backend}/pyproject.toml").read_text())["project"]
    ours = {dependency for dependency in project["dependencies"] if dependency.startswith("weightsync-")}
    assert ours == {"weightsync-api~=0.1.0", "weightsync-core~=0.1.0"}  # siblings by compatible version


def test_siblings_require_compatible_versions_of_each_other() -> None:
    projects = {path.parent: tomllib.loads(path.read_text())["project"]
                for folder in ("packages", "adapters", "tools") for path in (ROOT / folder).glob("*/pyproject.toml")}
    versions = {project["name"]: project["version"] for project in projects.values()}
    requirements = [(project["name"], requirement) for project in projects.values()
                    for requirement in [*project.get("dependencies", []),
                                        *(item for extra in project.get("optional-dependencies", {}).values()
                                          for item in extra)]
                    if requirement.startswith("weightsync")]
    assert len(requirements) > 30
    for name, requirement in requirements:
        sibling, _, version = requirement.partition("~=")
        sibling = sibling.split("[")[0]
        if sibling == name:  # an extra made of the distribution's own extras (weightsync[all])
            continue
        assert sibling in versions and version == versions[sibling], (name, requirement)
