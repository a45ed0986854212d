"""The LibCST transformer behind ``migrate_source``: one pass that finds every ``trainer`` site and rewrites it.

Everything is decided from the original tree: which classes are checkpoint engines or managers (by the qualified name
their bases resolve to), which names are bound to a renamed parameter (by LibCST's scope analysis), and where each
site is (for ``--check``). The rewrite then only swaps identifiers and argument keywords, so whitespace, comments and
the rest of the file come back byte for byte.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import (
    Assignment,
    ParentNodeProvider,
    PositionProvider,
    QualifiedNameProvider,
    Scope,
    ScopeProvider,
)

from weightsync.migrate import rules
from weightsync.migrate.findings import Finding, Note
from weightsync.migrate.rules import Rule
from weightsync.migrate.syntax import (
    TIGHT_EQUAL,
    all_parameters,
    defines_member,
    first_parameter,
    has_decorator,
    keyword_names,
    positional_count,
    safe_keyword_value,
)
from weightsync.migrate.targets import ManagerFlavour, is_engine_base, manager_flavour

__all__ = ["Migrator"]

TOPOLOGY_METHOD = "build_topology"
TOPOLOGY_PARAMETER_ORDER = ("actor_wg_world_size", "rollout_world_size", "metadata")
OLD_WORLD_SIZE = "trainer_world_size"
NEW_WORLD_SIZE = "actor_wg_world_size"
OLD_LOCAL_KWARGS = "trainer_kwargs"
NEW_LOCAL_KWARGS = "actor_wg_kwargs"
OLD_ACTOR_GROUP = "trainer"
NEW_ACTOR_GROUP = "actor_wg"


@dataclass
class _ClassFrame:
    node: cst.ClassDef
    # How many function bodies enclose the class body: a def at this depth is one of the class's own methods.
    function_depth: int


@dataclass
class _ClassKinds:
    engines: set[cst.ClassDef] = field(default_factory=set)
    managers: set[cst.ClassDef] = field(default_factory=set)
    # Whose manager each class derives from *directly*: that is whose __init__ `super().__init__(...)` calls. (An
    # indirect subclass's parent is a user class whose __init__ may take anything.)
    direct_manager_flavours: dict[cst.ClassDef, set[ManagerFlavour]] = field(default_factory=dict)
    # Manager subclasses that define their own `trainer` member: `self.trainer` there means the user's member.
    managers_owning_trainer: set[cst.ClassDef] = field(default_factory=set)


class Migrator(cst.CSTTransformer):
    """Rewrites as it leaves each node; ``findings`` and ``notes`` hold what it did and what it left alone."""

    METADATA_DEPENDENCIES = (QualifiedNameProvider, ScopeProvider, PositionProvider, ParentNodeProvider)

    def __init__(self) -> None:
        super().__init__()
        self.findings: list[Finding] = []
        self.notes: list[Note] = []
        self._kinds = _ClassKinds()
        # Name nodes of the original tree to rename, with their new spelling (scope-resolved renames: WS005-WS007).
        self._renames: dict[cst.Name, str] = {}
        # First parameters (`self`/`cls`) of methods of engine classes: `cls.build_topology(...)` reaches an engine.
        self._engine_receivers: set[cst.Param] = set()
        self._class_stack: list[_ClassFrame] = []
        # One entry per enclosing def: the class it is a method of, if any (what `super()` inside it refers to).
        self._function_stack: list[cst.ClassDef | None] = []

    # --- classification -------------------------------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> bool:
        # Classify every class before rewriting anything, so a function defined above a class still sees it.
        class_defs = [found for found in m.findall(node, m.ClassDef()) if isinstance(found, cst.ClassDef)]
        changed = True
        while changed:
            changed = False
            for class_def in class_defs:
                is_engine, is_manager, flavours = self._classify_bases(class_def)
                if flavours:
                    self._kinds.direct_manager_flavours[class_def] = flavours
                if is_engine and class_def not in self._kinds.engines:
                    self._kinds.engines.add(class_def)
                    changed = True
                if is_manager and class_def not in self._kinds.managers:
                    self._kinds.managers.add(class_def)
                    changed = True
        for manager in self._kinds.managers:
            if defines_member(manager, OLD_ACTOR_GROUP):
                self._kinds.managers_owning_trainer.add(manager)
                self._note(
                    manager.name,
                    f"class {manager.name.value} defines its own `{OLD_ACTOR_GROUP}`; its `self.{OLD_ACTOR_GROUP}` "
                    "is left alone",
                )
        return True

    def _classify_bases(self, class_def: cst.ClassDef) -> tuple[bool, bool, set[ManagerFlavour]]:
        """Whether the class is an engine, a manager, and whose managers it derives from directly."""
        is_engine = False
        is_manager = False
        flavours: set[ManagerFlavour] = set()
        for base in class_def.bases:
            if base.keyword is not None:  # metaclass=...
                continue
            expression = base.value
            if isinstance(expression, cst.Subscript):  # Generic[...]-style base
                expression = expression.value
            for name in self._qualified_names(expression):
                is_engine = is_engine or is_engine_base(name)
                flavour = manager_flavour(name)
                if flavour is not None:
                    flavours.add(flavour)
                    is_manager = True
            for local_class in self._local_bindings(expression):
                is_engine = is_engine or local_class in self._kinds.engines
                is_manager = is_manager or local_class in self._kinds.managers
        return is_engine, is_manager, flavours

    def _qualified_names(self, node: cst.CSTNode) -> set[str]:
        return {qualified.name for qualified in self.get_metadata(QualifiedNameProvider, node, set())}

    def _local_bindings(self, expression: cst.BaseExpression) -> Iterator[cst.CSTNode]:
        """The nodes (class definitions, parameters, ...) a bare name in this file may be bound to."""
        if not isinstance(expression, cst.Name):
            return
        scope = self.get_metadata(ScopeProvider, expression, None)
        if scope is None:
            return
        for assignment in scope[expression.value]:
            if isinstance(assignment, Assignment):
                yield assignment.node

    # --- structure tracking ---------------------------------------------------------------------------------

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._class_stack.append(_ClassFrame(node, len(self._function_stack)))
        return True

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._class_stack.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        owner = self._owning_class()
        self._function_stack.append(owner)
        if owner is None:
            return True
        receiver = None if has_decorator(node, "staticmethod") else first_parameter(node)
        if owner in self._kinds.engines:
            if receiver is not None:
                self._engine_receivers.add(receiver)
            if node.name.value == TOPOLOGY_METHOD:
                self._plan_topology_renames(node)
        if (
            owner in self._kinds.managers
            and owner not in self._kinds.managers_owning_trainer
            and receiver is not None
            and not has_decorator(node, "classmethod")
        ):
            self._plan_manager_attribute_renames(node, receiver)
        return True

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self._function_stack.pop()
        return updated_node

    def _owning_class(self) -> cst.ClassDef | None:
        """The class whose body directly holds the def being visited, if any."""
        if self._class_stack and self._class_stack[-1].function_depth == len(self._function_stack):
            return self._class_stack[-1].node
        return None

    # --- WS005 / WS006 / WS007: scope-resolved renames ------------------------------------------------------

    def _plan_topology_renames(self, method: cst.FunctionDef) -> None:
        scope = _function_scope(self, method)
        if scope is None:
            return
        parameter = next((p for p in all_parameters(method) if p.name.value == OLD_WORLD_SIZE), None)
        if parameter is not None:
            self._plan_binding_rename(method, scope, OLD_WORLD_SIZE, NEW_WORLD_SIZE, rules.TOPOLOGY_PARAMETER)
        if any(p.name.value == OLD_LOCAL_KWARGS for p in all_parameters(method)):
            # A parameter named trainer_kwargs is part of the method's signature, not a local; callers may pass it.
            return
        self._plan_binding_rename(method, scope, OLD_LOCAL_KWARGS, NEW_LOCAL_KWARGS, rules.TOPOLOGY_LOCAL)

    def _plan_binding_rename(self, method: cst.FunctionDef, scope: Scope, old: str, new: str, rule: Rule) -> None:
        """Rename every binding of ``old`` in ``method``'s own scope and every use of those bindings (closures too)."""
        bindings = [a for a in scope.assignments[old] if isinstance(a, Assignment)]
        if not bindings:
            return
        if self._uses_as_variable(method, new):
            self._note(
                bindings[0].node, f"`{old}` left alone: `{new}` is already used in this {method.name.value}"
            )
            return
        binding_names: list[cst.Name] = []
        for binding in bindings:
            if isinstance(binding.node, cst.Param):
                binding_names.append(binding.node.name)
            elif isinstance(binding.node, cst.Name):
                binding_names.append(binding.node)
            else:
                # Bound by an import or similar; renaming that would change what the name refers to.
                self._note(binding.node, f"`{old}` left alone: it is bound by a {type(binding.node).__name__}")
                return
        uses = [
            reference.node for binding in bindings for reference in binding.references
            if isinstance(reference.node, cst.Name)
        ]
        for name in [*binding_names, *uses]:
            self._rename(name, new, rule, rule.summary)

    def _uses_as_variable(self, node: cst.CSTNode, name: str) -> bool:
        """Whether ``name`` occurs in ``node`` as a variable (not as a call's keyword or an attribute after a dot),
        i.e. whether renaming something else to ``name`` could make two variables one."""
        for found in m.findall(node, m.Name(name)):
            parent = self.get_metadata(ParentNodeProvider, found, None)
            if isinstance(parent, cst.Arg) and parent.keyword is found:
                continue
            if isinstance(parent, cst.Attribute) and parent.attr is found:
                continue
            return True
        return False

    def _plan_manager_attribute_renames(self, method: cst.FunctionDef, receiver: cst.Param) -> None:
        scope = _function_scope(self, method)
        if scope is None:
            return
        for binding in scope.assignments[receiver.name.value]:
            if not isinstance(binding, Assignment) or binding.node is not receiver:
                continue
            for reference in binding.references:
                use = reference.node
                parent = self.get_metadata(ParentNodeProvider, use, None)
                if (
                    isinstance(parent, cst.Attribute)
                    and parent.value is use
                    and parent.attr.value == OLD_ACTOR_GROUP
                ):
                    self._rename(parent.attr, NEW_ACTOR_GROUP, rules.MANAGER_ATTRIBUTE, rules.MANAGER_ATTRIBUTE.summary)

    def _rename(self, name: cst.Name, new: str, rule: Rule, message: str) -> None:
        if name in self._renames:
            return
        self._renames[name] = new
        self._report(rule, name, message)

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        new = self._renames.get(original_node)
        return updated_node if new is None else updated_node.with_changes(value=new)

    # --- WS001 - WS004: calls -------------------------------------------------------------------------------

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        flavours = {
            flavour for name in self._qualified_names(original_node.func)
            if (flavour := manager_flavour(name)) is not None
        }
        func = original_node.func
        if not flavours and m.matches(func, m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__"))):
            owner = self._enclosing_method_owner()
            if owner is not None:
                flavours = self._kinds.direct_manager_flavours.get(owner, set())
        if flavours:
            return self._migrate_manager_call(original_node, updated_node, flavours)
        if isinstance(func, cst.Attribute) and func.attr.value == TOPOLOGY_METHOD:
            return self._migrate_topology_call(original_node, updated_node, func.value)
        return updated_node

    def _migrate_manager_call(
        self, original: cst.Call, updated: cst.Call, flavours: Collection[ManagerFlavour]
    ) -> cst.Call:
        args = self._rename_keyword(
            original, list(updated.args), OLD_ACTOR_GROUP, NEW_ACTOR_GROUP, rules.CONSTRUCTOR_KEYWORD
        )
        if len(flavours) == 1:
            flavour = next(iter(flavours))
            owner = "verl's" if flavour is ManagerFlavour.VERL else "weightsync's"
            target = f"{owner} CheckpointEngineManager"
            args = self._keywordize(original, args, flavour.parameter_order, rules.CONSTRUCTOR_POSITIONAL, target)
        elif positional_count(args):
            # e.g. `try: from verl... except ImportError: from weightsync.core...`: the two orders differ.
            self._note(original, "positional CheckpointEngineManager call left alone: the name may be verl's or ours")
        return updated.with_changes(args=args)

    def _migrate_topology_call(
        self, original: cst.Call, updated: cst.Call, receiver: cst.BaseExpression
    ) -> cst.Call:
        args = self._rename_keyword(
            original, list(updated.args), OLD_WORLD_SIZE, NEW_WORLD_SIZE, rules.TOPOLOGY_KEYWORD
        )
        if self._is_engine_receiver(receiver):
            args = self._keywordize(
                original, args, TOPOLOGY_PARAMETER_ORDER, rules.TOPOLOGY_POSITIONAL, "engine's build_topology"
            )
        return updated.with_changes(args=args)

    def _is_engine_receiver(self, receiver: cst.BaseExpression) -> bool:
        if any(is_engine_base(name) for name in self._qualified_names(receiver)):
            return True
        for bound in self._local_bindings(receiver):
            if bound in self._kinds.engines or bound in self._engine_receivers:
                return True
        return (
            isinstance(receiver, cst.Call)
            and m.matches(receiver.func, m.Name("super"))
            and self._enclosing_method_owner() in self._kinds.engines
        )

    def _enclosing_method_owner(self) -> cst.ClassDef | None:
        """The class of the method whose body is being visited (not counting nested defs), if it is a method."""
        return self._function_stack[-1] if self._function_stack else None

    def _rename_keyword(self, call: cst.Call, args: list[cst.Arg], old: str, new: str, rule: Rule) -> list[cst.Arg]:
        """Rename keyword ``old`` to ``new``, keeping the call's own spacing around ``=``."""
        keywords = keyword_names(args)
        if old not in keywords:
            return args
        if new in keywords:
            self._note(call, f"`{old}=` left alone: the call also passes `{new}=`")
            return args
        renamed: list[cst.Arg] = []
        for original_arg, arg in zip(call.args, args):
            if arg.keyword is not None and arg.keyword.value == old:
                self._report(rule, original_arg, rule.summary)
                arg = arg.with_changes(keyword=arg.keyword.with_changes(value=new))
            renamed.append(arg)
        return renamed

    def _keywordize(
        self, call: cst.Call, args: list[cst.Arg], order: Sequence[str], rule: Rule, target: str
    ) -> list[cst.Arg]:
        """Turn leading positional arguments into keywords named after the target's parameters, in order."""
        if any(arg.star == "*" for arg in args):
            self._note(call, "positional arguments left alone: a `*args` unpacking hides which parameter gets what")
            return args
        count = positional_count(args)
        if count == 0:
            return args
        if count > len(order):
            self._note(call, f"positional arguments left alone: {count} given, the target takes {len(order)}")
            return args
        names = order[:count]
        if set(names) & set(keyword_names(args)):
            self._note(call, "positional arguments left alone: a keyword repeats a positional parameter")
            return args
        spelled = ", ".join(f"`{name}=`" for name in names)
        self._report(rule, call.args[0], f"positional arguments to {target} become {spelled}")
        return [
            arg.with_changes(keyword=cst.Name(names[index]), equal=TIGHT_EQUAL, value=safe_keyword_value(arg.value))
            if index < count
            else arg
            for index, arg in enumerate(args)
        ]

    # --- reporting ------------------------------------------------------------------------------------------

    def _report(self, rule: Rule, node: cst.CSTNode, message: str) -> None:
        line, column = self._position(node)
        self.findings.append(Finding(rule, line, column, message))

    def _note(self, node: cst.CSTNode, message: str) -> None:
        line, column = self._position(node)
        self.notes.append(Note(line, column, message))

    def _position(self, node: cst.CSTNode) -> tuple[int, int]:
        position = self.get_metadata(PositionProvider, node).start
        return position.line, position.column + 1


def _function_scope(visitor: cst.CSTTransformer, method: cst.FunctionDef) -> Scope | None:
    # The def node itself belongs to the enclosing scope; any statement of its body belongs to its own.
    first_statement = method.body.body[0]
    return visitor.get_metadata(ScopeProvider, first_statement, None)
