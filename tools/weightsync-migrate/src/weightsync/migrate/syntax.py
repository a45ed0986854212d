"""Questions about LibCST nodes that need no metadata: parameters, decorators, class members, call arguments."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

__all__ = [
    "TIGHT_EQUAL",
    "all_parameters",
    "defines_member",
    "first_parameter",
    "has_decorator",
    "keyword_names",
    "positional_count",
    "safe_keyword_value",
]

# PEP 8 spacing for a keyword argument; LibCST's default AssignEqual renders `config = cfg`.
TIGHT_EQUAL = cst.AssignEqual(
    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
)


def all_parameters(method: cst.FunctionDef) -> list[cst.Param]:
    parameters = method.params
    return [*parameters.posonly_params, *parameters.params, *parameters.kwonly_params]


def first_parameter(method: cst.FunctionDef) -> cst.Param | None:
    positional = [*method.params.posonly_params, *method.params.params]
    return positional[0] if positional else None


def has_decorator(method: cst.FunctionDef, name: str) -> bool:
    return any(m.matches(decorator.decorator, m.Name(name)) for decorator in method.decorators)


def defines_member(class_def: cst.ClassDef, name: str) -> bool:
    """Whether the class body itself defines ``name`` (a method, property or class attribute)."""
    for statement in class_def.body.body:
        if isinstance(statement, cst.FunctionDef) and statement.name.value == name:
            return True
        if isinstance(statement, cst.SimpleStatementLine):
            for small in statement.body:
                if isinstance(small, cst.Assign) and any(
                    m.matches(target.target, m.Name(name)) for target in small.targets
                ):
                    return True
                if isinstance(small, cst.AnnAssign) and m.matches(small.target, m.Name(name)):
                    return True
    return False


def keyword_names(args: Sequence[cst.Arg]) -> set[str]:
    return {arg.keyword.value for arg in args if arg.keyword is not None}


def positional_count(args: Sequence[cst.Arg]) -> int:
    """How many plain positional arguments lead the call (they always precede keywords and `**`)."""
    count = 0
    for arg in args:
        if arg.keyword is not None or arg.star:
            break
        count += 1
    return count


def safe_keyword_value(value: cst.BaseExpression) -> cst.BaseExpression:
    """Parenthesise values that are only valid unparenthesised as a sole positional argument (`f(x for x in y)`) or
    not valid after `=` at all (`f(x := 1)` is fine, `f(k=x := 1)` is not)."""
    if isinstance(value, (cst.GeneratorExp, cst.NamedExpr)) and not value.lpar:
        return value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return value
