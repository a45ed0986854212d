"""Which classes the codemod treats as verl's or weightsync's, by fully qualified name.

Matching is by the name an import resolves to, never by the bare class name: a ``CheckpointEngineManager`` or
``CheckpointEngine`` imported from any other package is someone else's class and keeps its ``trainer`` spelling.
"""

from __future__ import annotations

import enum
from typing import Final


class ManagerFlavour(enum.Enum):
    """Whose ``CheckpointEngineManager`` a call constructs; the value is its constructor's parameter order."""

    # verl 0.9.1: CheckpointEngineManager(config, actor_wg, replicas); older verl named the second one `trainer`.
    VERL = ("config", "actor_wg", "replicas")
    # weightsync.core: CheckpointEngineManager(*, backend, actor_wg, replicas, config=None).
    WEIGHTSYNC = ("backend", "actor_wg", "replicas", "config")

    @property
    def parameter_order(self) -> tuple[str, ...]:
        order: tuple[str, ...] = self.value
        return order


_VERL_PACKAGE: Final = "verl.checkpoint_engine"
_VERL_MANAGER_NAMES: Final = frozenset(
    {f"{_VERL_PACKAGE}.CheckpointEngineManager", f"{_VERL_PACKAGE}.base.CheckpointEngineManager"}
)

# verl 0.9.1's engine base and every engine it ships, by package (which re-exports them) and by defining module: a
# concrete backend is subclassed to override build_topology as often as the ABC is, so both count as the base.
_VERL_ENGINE_CLASSES_BY_MODULE: Final[dict[str, tuple[str, ...]]] = {
    "base": ("CheckpointEngine", "CheckpointEngineWithCache", "ColocatedCheckpointEngine"),
    "nccl_checkpoint_engine": ("NCCLCheckpointEngine",),
    "hccl_checkpoint_engine": ("HCCLCheckpointEngine",),
    "nixl_checkpoint_engine": ("NIXLCheckpointEngine",),
    "kimi_checkpoint_engine": ("KIMICheckpointEngine",),
    "mooncake_checkpoint_engine": ("MooncakeCheckpointEngine",),
    "delta_checkpoint_engine": ("DeltaShardedCheckpointEngine",),
}
_VERL_ENGINE_NAMES: Final = frozenset(
    name
    for module, classes in _VERL_ENGINE_CLASSES_BY_MODULE.items()
    for cls in classes
    for name in (f"{_VERL_PACKAGE}.{cls}", f"{_VERL_PACKAGE}.{module}.{cls}")
)


def _in_package(qualified_name: str, package: str, class_name: str) -> bool:
    """Whether ``qualified_name`` is ``package.class_name`` or ``package.<submodule...>.class_name``.

    Our own packages re-export their public classes but also define them in submodules (``weightsync.api.protocols``,
    ...); a user may import from either, so any module under the package counts.
    """
    return qualified_name.startswith(package + ".") and qualified_name.endswith("." + class_name)


def manager_flavour(qualified_name: str) -> ManagerFlavour | None:
    """Whose ``CheckpointEngineManager`` ``qualified_name`` names, or ``None`` when it is nobody we migrate."""
    if qualified_name in _VERL_MANAGER_NAMES:
        return ManagerFlavour.VERL
    if _in_package(qualified_name, "weightsync.core", "CheckpointEngineManager"):
        return ManagerFlavour.WEIGHTSYNC
    return None


def is_engine_base(qualified_name: str) -> bool:
    """Whether ``qualified_name`` is verl's or our checkpoint-engine base (or one of verl's shipped engines)."""
    return (
        qualified_name in _VERL_ENGINE_NAMES
        or _in_package(qualified_name, "weightsync.api", "CheckpointEngine")
        or _in_package(qualified_name, "weightsync.core", "BucketCheckpointEngine")
    )
