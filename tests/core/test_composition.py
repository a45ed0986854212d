"""Backends plug into core by composition: checked from outside, on the source and on the loaded classes."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import tomllib
from typing import Any

import pytest
from packaging.requirements import Requirement

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


def _projects() -> list[dict[str, Any]]:
    """The ``[project]`` table of every distribution."""
    return [tomllib.loads(path.read_text())["project"]
            for folder in ("packages", "adapters", "tools") for path in sorted((ROOT / folder).glob("*/pyproject.toml"))]


def _requirements(project: dict[str, Any]) -> list[str]:
    """A distribution's requirements, its extras' included."""
    return [*project.get("dependencies", []),
            *(item for extra in project.get("optional-dependencies", {}).values() for item in extra)]


def test_siblings_require_compatible_versions_of_each_other() -> None:
    projects = _projects()
    versions = {project["name"]: project["version"] for project in projects}
    requirements = [(project["name"], requirement) for project in projects
                    for requirement in _requirements(project) if requirement.startswith("weightsync")]
    assert len(requirements) > 30
    for name, requirement in requirements:
        sibling, _, version = requirement.partition("~=")
        sibling = sibling.split("[")[0]
        if sibling == name:  # an extra made of the distribution's own extras (weightsync[all])
            continue
        assert sibling in versions and version == versions[sibling], (name, requirement)


def floor_problems(projects: list[dict[str, Any]], environments: dict[str, Any]) -> list[str]:
    """Where the distributions claim what CI does not test: a ``requires-python``, torch or Ray floor other than
    what the hatch environments install (``python`` of their matrix, their ``==`` pins), or an exact pin of another
    project inside a library (it would clash with what vLLM or verl pin next)."""
    pins: dict[str, set[str]] = {}
    for environment in environments.values():
        for item in [*environment.get("dependencies", []), *environment.get("extra-dependencies", [])]:
            requirement = Requirement(item)
            pins.setdefault(requirement.name, set()).update(
                spec.version for spec in requirement.specifier if spec.operator == "==")
    pythons = {python for environment in environments.values() for row in environment.get("matrix", [])
               for python in row.get("python", [])}
    floors = {name: ".".join(min(pins[name]).split(".")[:2]) for name in ("torch", "ray")}
    problems = [f"the environments install {name} {sorted(pins[name])}" for name in floors if len(pins[name]) != 1]
    for project in projects:
        name = project["name"]
        if project.get("requires-python") != f">={min(pythons)}":
            problems.append(f"{name}: requires-python {project.get('requires-python')!r}; CI runs {sorted(pythons)}")
        for text in _requirements(project):
            requirement = Requirement(text)
            if requirement.name.startswith("weightsync"):
                continue
            if any(spec.operator in ("==", "===") for spec in requirement.specifier):
                problems.append(f"{name}: {text} is an exact pin")
            lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            if requirement.name in floors and lower != [floors[requirement.name]]:
                problems.append(f"{name}: {text}; the environments install {requirement.name} "
                                f"{floors[requirement.name]}")
    return problems


def test_declared_floors_are_what_the_environments_install() -> None:
    environments = tomllib.loads((ROOT / "hatch.toml").read_text())["envs"]
    projects = _projects()
    assert len(projects) >= 18
    assert floor_problems(projects, environments) == []
    # Negative control: the floors and pins these packages declared before are each found.
    old = {"name": "old", "requires-python": ">=3.10",
           "dependencies": ["torch>=2.4", "ray>=2.9", "nixl==1.5.1"]}
    assert len(floor_problems([old], environments)) == 4


def test_every_package_says_its_distributions_version() -> None:
    checked = []
    for folder in sorted(path.parent for base in ("packages", "adapters", "tools")
                         for path in (ROOT / base).glob("*/pyproject.toml")):
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        for init in sorted(folder.glob("src/weightsync/*/__init__.py")):
            module = f"weightsync.{init.parent.name}"
            if importlib.util.find_spec(module) is None:  # verl's and vLLM's adapters: their own environments
                continue
            assert importlib.import_module(module).__version__ == project["version"], module
            checked.append(module)
    assert len(checked) >= 14, checked
