"""A kernel's integer index expressions evaluated for every work-item of its launch (numpy, C's integer semantics),
as staging.py plans a work-group's shared reads from them: the variables an expression reads, its definition
inlined, its value per item.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fblc.codegen.ir import Binary, Call, Cast, Const, Expr, Select, Unary, Var


class Unplannable(Exception):
    """An index the plan cannot evaluate per item (a loop variable in an item's term, an unknown operation)."""


def leaves(expr: Expr, decls: dict[Var, Expr]) -> set[Var]:
    """The variables `expr` reads once the const values it reads are replaced by their definitions."""
    if isinstance(expr, Var):
        return leaves(decls[expr], decls) if expr in decls else {expr}
    found: set[Var] = set()
    for child in _children(expr):
        found |= leaves(child, decls)
    return found


def _children(expr: Expr) -> list[Expr]:
    out: list[Expr] = []
    for value in vars(expr).values():
        if isinstance(value, Expr):
            out.append(value)
        elif isinstance(value, tuple):
            out.extend(v for v in value if isinstance(v, Expr))
    return out


def inline(expr: Expr, decls: dict[Var, Expr], replacing: dict[Var, Expr]) -> Expr:
    """`expr` with the const values it reads replaced by their definitions and the variables of `replacing` by
    theirs (the item's index at the group's first item)."""
    if isinstance(expr, Var):
        if expr in replacing:
            return replacing[expr]
        return inline(decls[expr], decls, replacing) if expr in decls else expr
    changes = {}
    for field in dataclasses.fields(expr):  # type: ignore[arg-type]
        value = getattr(expr, field.name)
        if isinstance(value, Expr):
            changes[field.name] = inline(value, decls, replacing)
        elif isinstance(value, tuple) and all(isinstance(v, Expr) for v in value):
            changes[field.name] = tuple(inline(v, decls, replacing) for v in value)
    return dataclasses.replace(expr, **changes)  # type: ignore[type-var]


def _c_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    quotient = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -quotient, quotient)


#: C's integer operators on numpy's int64 (index arithmetic stays far below 2^63: div_index's 64-bit products)
_BINARY = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": _c_div,
           "%": lambda a, b: a - _c_div(a, b) * b, ">>": np.right_shift, "<<": np.left_shift,
           "&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor,
           "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
           "!=": np.not_equal, "&&": np.logical_and, "||": np.logical_or}
_CALLS = {"min": np.minimum, "max": np.maximum, "clamp": lambda x, low, high: np.minimum(np.maximum(x, low), high),
          "abs": np.abs}


def evaluate(expr: Expr, decls: dict[Var, Expr], item: Var, items: np.ndarray) -> np.ndarray:
    """An int expression of the item at every item of the launch."""
    if isinstance(expr, Var):
        if expr == item:
            return items
        if expr not in decls:
            raise Unplannable(expr)
        return evaluate(decls[expr], decls, item, items)
    if isinstance(expr, Const) and not expr.dtype.is_float:
        return np.full_like(items, int(expr.value))
    if isinstance(expr, Binary) and expr.op in _BINARY:
        a, b = evaluate(expr.a, decls, item, items), evaluate(expr.b, decls, item, items)
        return np.asarray(_BINARY[expr.op](a, b), dtype=np.int64)
    if isinstance(expr, Unary) and expr.op in ("-", "!"):
        value = evaluate(expr.a, decls, item, items)
        return -value if expr.op == "-" else (value == 0).astype(np.int64)
    if isinstance(expr, Call) and expr.function in _CALLS:
        return np.asarray(_CALLS[expr.function](*(evaluate(a, decls, item, items) for a in expr.args)),
                          dtype=np.int64)
    if isinstance(expr, Select):
        return np.where(evaluate(expr.condition, decls, item, items) != 0,
                        evaluate(expr.if_true, decls, item, items), evaluate(expr.if_false, decls, item, items))
    if isinstance(expr, Cast) and not expr.dtype.is_float:
        return evaluate(expr.a, decls, item, items)
    raise Unplannable(expr)
