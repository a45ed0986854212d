"""weightsync-core's sub-packages lie in one order along the data path, and no module imports a layer above its own;
no private name crosses a sub-package or a distribution. Both computed from the AST of every source module.

The order, top to bottom: control → worker → pipeline → delta → transports → wire → native. ``weightsync.core`` itself
and ``weightsync.core.backend`` are facades over all of them (what users and backends import): no layer imports them.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "packages" / "weightsync-core" / "src" / "weightsync" / "core"
LAYERS = ("control", "worker", "pipeline", "delta", "transports", "wire", "native")
FACADES = frozenset({"weightsync.core", "weightsync.core.backend"})


def module_name(path: pathlib.Path) -> str:
    """``weightsync.x.y`` for a file under some distribution's ``src`` folder (a package by its own name)."""
    parts = path.with_suffix("").parts[path.parts.index("src") + 1:]
    return ".".join(part for part in parts if part != "__init__")


def imported(tree: ast.AST, module: str) -> list[tuple[int, str, list[str]]]:
    """Every import of ``tree`` (inside functions and ``TYPE_CHECKING`` blocks too): (line, the module it names,
    the names it takes from it). A relative import is taken from ``module``'s package (``module`` a plain module)."""
    package = module.split(".")[:-1]
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [base])])
            found.append((node.lineno, base, [alias.name for alias in node.names]))
    return found


def layer_of(module: str) -> str | None:
    """The layer of a module of weightsync-core (None for the facades and for modules outside it)."""
    parts = module.split(".")
    if parts[:2] != ["weightsync", "core"] or module in FACADES:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in LAYERS else None


def target(base: str, name: str) -> str:
    """What ``from base import name`` reaches: the sub-module ``base.name`` when there is one, else ``base``."""
    candidate = f"{base}.{name}"
    place = CORE.joinpath(*candidate.split(".")[2:])
    if candidate.startswith("weightsync.core.") and (place.is_dir() or place.with_suffix(".py").is_file()):
        return candidate
    return base


def upward_imports(module: str, source: str) -> list[str]:
    """The imports of ``module`` (its source ``source``) that reach a layer above its own, or a facade."""
    own = layer_of(module)
    if own is None:
        return []
    bad = []
    for line, base, names in imported(ast.parse(source), module):
        for reached in ({target(base, name) for name in names} if names else {base}):
            if reached in FACADES:
                bad.append(f"{module}:{line} imports the facade {reached}")
                continue
            layer = layer_of(reached)
            if layer is not None and LAYERS.index(layer) < LAYERS.index(own):
                bad.append(f"{module}:{line} ({own}) imports {reached} ({layer}), a layer above")
    return bad


def owner(module: str) -> str:
    """Who a private name belongs to: a sub-package of weightsync-core, or a distribution's top package."""
    parts = module.split(".")
    if parts[:2] == ["weightsync", "core"]:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def private_crossings(module: str, source: str) -> list[str]:
    """``from x import _name`` and ``x._name`` in ``module`` where ``x`` is ours and belongs to another owner
    (:func:`owner`); another project's private modules (``nixl._api``, NIXL's documented import) are its own."""
    tree = ast.parse(source)
    bad: list[str] = []
    aliases: dict[str, str] = {}
    for line, base, names in imported(tree, module):
        for name in names:
            reached = target(base, name)
            if reached != base:  # a module, bound to its name (or alias)
                aliases[name] = reached
            elif (name.startswith("_") and not name.startswith("__") and base.startswith("weightsync.")
                  and owner(base) != owner(module)):
                bad.append(f"{module}:{line} imports {base}.{name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            read = aliases.get(node.value.id, "")
            if read.startswith("weightsync.") and owner(read) != owner(module):
                bad.append(f"{module}:{node.lineno} reads {read}.{node.attr}")
    return bad


def sources() -> list[pathlib.Path]:
    return sorted(path for folder in ("packages", "adapters", "tools") for path in (ROOT / folder).glob("*/src/**/*.py"))


def test_every_module_of_core_has_a_layer() -> None:
    loose = [path.name for path in CORE.glob("*.py") if path.name not in {"__init__.py", "backend.py"}]
    assert loose == []
    assert sorted(path.name for path in CORE.iterdir() if path.is_dir() and path.name != "__pycache__") == sorted(LAYERS)


def test_no_module_imports_a_layer_above_its_own() -> None:
    modules = list(CORE.rglob("*.py"))
    assert len(modules) > 30
    bad = [line for path in modules for line in upward_imports(module_name(path), path.read_text())]
    assert bad == []


def test_no_private_name_crosses_a_sub_package_or_a_distribution() -> None:
    bad = [line for path in sources() for line in private_crossings(module_name(path), path.read_text())]
    assert bad == []


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module → the modules of ``modules`` (name → source) it imports, inside functions and ``TYPE_CHECKING`` blocks
    too (a package's ``__init__`` counts as its own module)."""
    graph: dict[str, set[str]] = {}
    for module, source in modules.items():
        reached: set[str] = set()
        for _, base, names in imported(ast.parse(source), module):
            reached |= {f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names or [""]}
        graph[module] = {other for other in reached if other in modules and other != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (an import circle), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_core() -> None:
    modules = {module_name(path): path.read_text() for path in CORE.rglob("*.py")}
    assert cycles(import_graph(modules)) == []


def test_the_circle_check_finds_a_circle() -> None:
    # Negative control: three modules that import each other in a ring, one only for type checking.
    modules = {
        "weightsync.core.transports.a": "from weightsync.core.transports.b import B",
        "weightsync.core.transports.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from weightsync.core.transports import c",
        "weightsync.core.transports.c": "import weightsync.core.transports.a",
        "weightsync.core.transports.d": "from weightsync.core.transports.a import A",
    }
    assert cycles(import_graph(modules)) == [["weightsync.core.transports.a", "weightsync.core.transports.b",
                                              "weightsync.core.transports.c"]]


@pytest.mark.parametrize("source", [
    "from weightsync.core.pipeline.planner import plan_buckets",
    "from weightsync.core.pipeline import planner",
    "import weightsync.core.control.manager",
    "def later() -> None:\n    from weightsync.core.delta.encoding import apply",
    "from weightsync.core import backend",
    "from ..delta import encoding",
])
def test_the_direction_check_finds_an_upward_import(source: str) -> None:
    # Negative control: each of these, in a module of the wire layer, reaches a layer above it or a facade.
    assert upward_imports("weightsync.core.wire.codec", source)
    assert not upward_imports("weightsync.core.control.manager", source.replace("from weightsync.core import backend", ""))


@pytest.mark.parametrize("source", [
    "from weightsync.core.native import _ABI",
    "from weightsync.core import native\nnative._load_helper()",
    "import weightsync.core.native as n\nn._ABI",
])
def test_the_private_check_finds_a_crossing(source: str) -> None:
    assert private_crossings("weightsync.core.delta.encoding", source)
    assert private_crossings("weightsync.nixl.transport", source)
    assert not private_crossings("weightsync.core.native.build", source)


LOADED = ("import sys\n{code}\nprint(sorted(m for m in sys.modules if m.startswith('weightsync.core.')), "
          "'torch' in sys.modules)")


def loaded_after(code: str) -> str:
    """What importing ``code`` in a fresh interpreter loads: weightsync.core's modules, and whether torch."""
    done = subprocess.run([sys.executable, "-c", LOADED.format(code=code)], capture_output=True, text=True,
                          timeout=300, check=True)
    return done.stdout.strip()


def test_the_top_level_imports_nothing_until_a_name_is_used() -> None:
    assert loaded_after("import weightsync.core") == "[] False"
    # Control: the probe sees modules as soon as a name is used.
    used = loaded_after("import weightsync.core\nweightsync.core.CheckpointEngineManager")
    assert "'weightsync.core.control.manager'" in used and used.endswith("True")


def too_long(path: pathlib.Path, *, module_lines: int, function_lines: int) -> list[str]:
    """A module over ``module_lines`` lines, and every function over ``function_lines`` (decorators excluded)."""
    source = path.read_text()
    found = [f"{path.name}: {source.count(chr(10))} lines"] if source.count("\n") > module_lines else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > function_lines:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_over_the_house_limits() -> None:
    # 450 lines a module, 60 a function; 80 a function of the tools.
    bad = [line for path in sources() for line in too_long(
        path, module_lines=450, function_lines=80 if "tools" in path.relative_to(ROOT).parts[:1] else 60)]
    assert bad == []
    # Control: the same check with tighter limits finds plenty.
    assert too_long(CORE / "control" / "manager.py", module_lines=100, function_lines=20)
