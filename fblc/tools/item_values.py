"""The integer values of a kernel's IR expressions for every work-item at once (numpy), where they can be known.

A kernel's prologue computes its indices from get_global_id (and, in a kernel written for one work-group size,
get_local_id / get_group_id); `evaluate` computes such an expression for work-items 0 .. items - 1 as a numpy
array, so fblc/tools/kernel_stats.py can weigh an `if` by the work-items that take it (a conv's per-lane edge
path runs only at row ends) and a loop by each work-item's own trips. What depends on a texel, a float, a loop
variable or an array element is Unknown.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fblc.codegen import ir

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor,
    "<<": np.left_shift, ">>": np.right_shift, "<": np.less, "<=": np.less_equal, ">": np.greater,
    ">=": np.greater_equal, "==": np.equal, "!=": np.not_equal, "&&": np.logical_and, "||": np.logical_or}
_CALLS: dict[str, Callable[..., Any]] = {"min": np.minimum, "max": np.maximum, "clamp": np.clip}
INTEGERS = ("int", "uint", "ulong", "uchar")


class Unknown(Exception):
    """An expression whose value per work-item cannot be known from the IR alone."""


class Items:
    """Work-items 0 .. items - 1 of a launch (groups of `group_size` where the kernel is written for one)."""

    def __init__(self, items: int, group_size: int | None = None) -> None:
        self.ids = np.arange(max(items, 1), dtype=np.int64)
        self.group_size = group_size

    def builtin(self, function: str) -> np.ndarray:
        if function == "get_global_id":
            return self.ids
        if self.group_size and function == "get_local_id":
            return self.ids % self.group_size
        if self.group_size and function == "get_group_id":
            return self.ids // self.group_size
        raise Unknown(function)


def evaluate(e: ir.Expr, values: dict[Any, Any], items: Items, key: Callable[[ir.Var], Any]) -> Any:
    """`e`'s value for every work-item (an array, or a number where it is the same for all), or Unknown;
    `values`: the known variables by `key`."""
    if isinstance(e, ir.Const):
        if not isinstance(e.value, (int, bool)) or e.dtype.scalar not in INTEGERS:
            raise Unknown(e)
        return np.uint64(int(e.value)) if e.dtype.scalar == "ulong" else np.int64(int(e.value))
    if isinstance(e, ir.Var):
        if key(e) in values:
            return values[key(e)]
        raise Unknown(e)
    if isinstance(e, ir.Binary) and e.op in _BINARY:
        a, b = evaluate(e.a, values, items, key), evaluate(e.b, values, items, key)
        if "ulong" in (e.dtype.scalar, e.a.dtype.scalar, e.b.dtype.scalar):  # a division by reciprocal: 64 bits
            a, b = np.asarray(a).astype(np.uint64), np.asarray(b).astype(np.uint64)
        result = _BINARY[e.op](a, b)
        return result.astype(np.int64) if np.asarray(result).dtype == bool else result
    if isinstance(e, ir.Binary) and e.op in ("/", "%") and e.dtype.scalar in INTEGERS:
        a, b = (np.asarray(evaluate(x, values, items, key)).astype(np.int64) for x in (e.a, e.b))
        if np.any(b == 0):
            raise Unknown(e)
        quotient = np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))  # C truncates toward zero
        return quotient if e.op == "/" else a - quotient * b
    if isinstance(e, ir.Unary) and e.dtype.scalar in INTEGERS:
        a = evaluate(e.a, values, items, key)
        return -np.asarray(a) if e.op == "-" else (np.asarray(a) == 0).astype(np.int64)
    if isinstance(e, ir.Cast) and e.dtype.scalar in INTEGERS:
        return np.asarray(evaluate(e.a, values, items, key)).astype(np.uint64 if e.dtype.scalar == "ulong"
                                                                      else np.int64)
    if isinstance(e, ir.Select) and e.dtype.scalar in INTEGERS:
        return np.where(evaluate(e.condition, values, items, key) != 0, evaluate(e.if_true, values, items, key),
                        evaluate(e.if_false, values, items, key))
    if isinstance(e, ir.Call):
        if e.function in ("get_global_id", "get_local_id", "get_group_id"):
            return items.builtin(e.function)
        if e.function in _CALLS and e.dtype.scalar in INTEGERS:
            return _CALLS[e.function](*(evaluate(a, values, items, key) for a in e.args))
    raise Unknown(e)


def per_item(value: Any, items: Items) -> np.ndarray:
    """`value` as one number per work-item."""
    return np.broadcast_to(np.asarray(value, dtype=np.float64), items.ids.shape)
