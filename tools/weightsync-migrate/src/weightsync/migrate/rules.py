"""The rules of ``weightsync migrate``: one identifier per kind of rewrite.

Every site the codemod changes is reported under exactly one rule, so ``--check`` output can be filtered and each
rule is documented once (here, and in the table in ``docs/MIGRATING.md``; a test keeps the two in step).

WS001
    ``CheckpointEngineManager(..., trainer=X)`` becomes ``CheckpointEngineManager(..., actor_wg=X)``. Applies only to
    verl's manager (``verl.checkpoint_engine``, ``verl.checkpoint_engine.base``) and ours (``weightsync.core``),
    recognised by qualified name through every import form; a same-named class from any other module is left alone.
    ``super().__init__(..., trainer=X)`` in a class deriving directly from one of them counts as constructing it.
WS002
    Positional arguments to one of those managers become keywords, in that class's own parameter order: verl's
    ``config, actor_wg, replicas``; ours ``backend, actor_wg, replicas, config`` (ours is keyword-only, so a positional
    call cannot work at all).
WS003
    Any ``<something>.build_topology(..., trainer_world_size=N, ...)`` call becomes ``actor_wg_world_size=N``, whatever
    the receiver: that keyword on that method name is specific enough even when the class is fetched from a registry.
WS004
    Positional arguments to ``build_topology`` become keywords (``actor_wg_world_size``, ``rollout_world_size``,
    ``metadata``) when the receiver is known to be a checkpoint engine: a class derived from verl's or our engine base,
    ``cls``/``self`` inside such a class, or ``super()`` inside one.
WS005
    In a class derived from verl's or our engine base, the ``build_topology`` parameter ``trainer_world_size`` and
    every use of it in the method body become ``actor_wg_world_size``.
WS006
    In that same ``build_topology`` method, the local variable ``trainer_kwargs`` becomes ``actor_wg_kwargs``.
WS007
    In a class derived from verl's or our ``CheckpointEngineManager``, ``self.trainer`` becomes ``self.actor_wg``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class Rule:
    """One kind of rewrite: its identifier and the one-line message ``--check`` prints for each site."""

    id: str
    summary: str


CONSTRUCTOR_KEYWORD: Final = Rule("WS001", "CheckpointEngineManager keyword `trainer=` is now `actor_wg=`")
CONSTRUCTOR_POSITIONAL: Final = Rule(
    "WS002", "positional CheckpointEngineManager arguments become keywords in the class's parameter order"
)
TOPOLOGY_KEYWORD: Final = Rule("WS003", "build_topology keyword `trainer_world_size=` is now `actor_wg_world_size=`")
TOPOLOGY_POSITIONAL: Final = Rule(
    "WS004",
    "positional build_topology arguments become keywords `actor_wg_world_size=`, `rollout_world_size=`, `metadata=`",
)
TOPOLOGY_PARAMETER: Final = Rule(
    "WS005", "build_topology parameter `trainer_world_size` (and its uses) is now `actor_wg_world_size`"
)
TOPOLOGY_LOCAL: Final = Rule("WS006", "build_topology local `trainer_kwargs` is now `actor_wg_kwargs`")
MANAGER_ATTRIBUTE: Final = Rule("WS007", "CheckpointEngineManager attribute `self.trainer` is now `self.actor_wg`")

ALL_RULES: Final[tuple[Rule, ...]] = (
    CONSTRUCTOR_KEYWORD,
    CONSTRUCTOR_POSITIONAL,
    TOPOLOGY_KEYWORD,
    TOPOLOGY_POSITIONAL,
    TOPOLOGY_PARAMETER,
    TOPOLOGY_LOCAL,
    MANAGER_ATTRIBUTE,
)
