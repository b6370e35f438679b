"""Texel indices as integer affine forms, and whether one takes a different value at every work-item of a launch.

The in-place proof (codegen/inplace.py) reads a kernel's texel index as an integer combination of the work-item
ids, the loops' variables, a constant and floor quotients of such forms by constants (`affine`: shifts, masks of
low bits and ir.div_index's reciprocal multiplies folded, so a tile's row and column put back together are the
index again), then enumerates it over the launch's work-items and the loops' values (`injective`): a texel two
points share, or a form it cannot read, proves nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from fblc.codegen import ir as kir
from fblc.codegen.ir.expressions import Binary, Call, Cast, Const, Expr, Var
from fblc.texel_layout import reciprocal

Affine = tuple  # sorted ((atom, coefficient) ...), the non-zero terms of an `affine` form


Atom = tuple  # ("1", 0) the constant, ("gid", axis), ("loop", name), ("div", form, divisor)


def affine(expr: Expr, declared: dict[str, Any]) -> dict[Atom, int] | None:
    """`expr` as {atom: coefficient}: an integer combination of the global ids (("gid", axis)), the loops'
    variables, the constant (("1", 0)) and the floor quotients and remainders of such forms by constants (a
    shift, a mask of low bits, the reciprocal multiply of ir.div_index); None where it is not such a form (then
    nothing is proved). Every index here is non-negative (the kernels' indices are), so floors nest,
    (x / a) / b is x / (a b), and a remainder is x - d (x / d): d (x / d) + x % d is x again, a tile's row and
    column put together."""
    if isinstance(expr, Const) and isinstance(expr.value, int) and not isinstance(expr.value, bool):
        return {("1", 0): int(expr.value)}
    if isinstance(expr, Call) and expr.function in WORK_ITEM_IDS and len(expr.args) == 1 \
            and isinstance(expr.args[0], Const):
        return {(WORK_ITEM_IDS[expr.function], int(expr.args[0].value)): 1}
    if isinstance(expr, Var):
        key = c_name(expr)
        if key in declared and isinstance(declared[key], kir.For):  # a loop's variable: an atom of its own
            return {("loop", key): 1}
        init = declared.get(key)
        return None if init is None else affine(init, declared)
    if isinstance(expr, Cast) and not expr.dtype.is_float and expr.dtype.lanes == 1:
        divided = _reciprocal_division(expr.a)
        if divided is not None:
            form = affine(divided[0], declared)
            return None if form is None else _divide(form, divided[1])
        return affine(expr.a, declared) if expr.dtype.scalar in ("int", "uint", "ulong") else None
    if not isinstance(expr, Binary):
        return None
    a, b = affine(expr.a, declared), affine(expr.b, declared)
    if a is None or b is None:
        return None
    constant_b = set(b) <= {("1", 0)}
    if expr.op in ("+", "-"):
        sign = 1 if expr.op == "+" else -1
        return _clean({k: a.get(k, 0) + sign * b.get(k, 0) for k in a.keys() | b.keys()})
    if expr.op == "*" and (constant_b or set(a) <= {("1", 0)}):
        factor, form = (b.get(("1", 0), 0), a) if constant_b else (a.get(("1", 0), 0), b)
        return {k: v * factor for k, v in form.items()}
    if expr.op == ">>" and constant_b:
        return _divide(a, 1 << b.get(("1", 0), 0))
    if expr.op == "&" and constant_b:
        mask = b.get(("1", 0), 0)
        if mask >= 0 and mask & (mask + 1) == 0:  # 2^k - 1: the remainder by 2^k, x - 2^k (x / 2^k)
            return _clean({k: a.get(k, 0) - (mask + 1) * _divide(a, mask + 1).get(k, 0)
                           for k in a.keys() | _divide(a, mask + 1).keys()})
    return None


def _reciprocal_division(expr: Expr) -> tuple[Expr, int] | None:
    """(x, d) where `expr` is ((ulong)x * m) >> (32 + s) with (m, s) the reciprocal of d (ir.div_index's
    division), else None."""
    if not (isinstance(expr, Binary) and expr.op == ">>" and isinstance(expr.b, Const)
            and isinstance(expr.a, Binary) and expr.a.op == "*" and isinstance(expr.a.b, Const)
            and isinstance(expr.a.a, Cast)):
        return None
    multiplier, shift = int(expr.a.b.value), int(expr.b.value) - 32
    if multiplier <= 0 or shift < 0:
        return None
    divisor = round((1 << (32 + shift)) / multiplier)
    return (expr.a.a.a, divisor) if divisor >= 2 and reciprocal(divisor) == (multiplier, shift) else None


def _divide(form: dict[Atom, int], divisor: int) -> dict[Atom, int]:
    """The floor quotient of non-negative `form` by `divisor`: exact where every coefficient is a multiple of it,
    a quotient of a quotient nested into one, else an atom."""
    if divisor == 1:
        return form
    if all(v % divisor == 0 for v in form.values()):
        return {k: v // divisor for k, v in form.items()}
    terms = [(k, v) for k, v in form.items() if v != 0]
    if len(terms) == 1 and terms[0][1] == 1 and terms[0][0][0] == "div":
        inner = terms[0][0]
        return {("div", inner[1], inner[2] * divisor): 1}
    return {("div", _frozen(form), divisor): 1}


def c_name(var: Var) -> str:
    """The variable's name in the rendered C (the renderer's rule): what tells two variables apart there."""
    return var.name or f"{var.kind}{var.number}"


def declarations(statements: Sequence[kir.Statement]) -> dict[str, Any]:
    """Each const variable's value and each loop's `For`, by the name the renderer gives the variable; a name
    declared twice (shadowed in a nested scope) is left out, so nothing is proved through it."""
    inits: dict[str, list[Any]] = {}
    for statement in kir.walk(statements):
        if isinstance(statement, (kir.Declare, kir.DeclareArray, kir.For)):
            var = statement.var
            init = statement if isinstance(statement, kir.For) else \
                statement.init if isinstance(statement, kir.Declare) and statement.const else None
            inits.setdefault(c_name(var), []).append(init)
    return {key: found[0] for key, found in inits.items() if len(found) == 1 and found[0] is not None}


def _frozen(form: dict[Atom, int]) -> tuple:
    return tuple(sorted((k, v) for k, v in form.items() if v != 0))


def index_form(expr: Expr, declared: dict[str, Any]) -> Affine | None:
    form = affine(expr, declared)
    return None if form is None else _frozen(form)


def _clean(form: dict[Atom, int]) -> dict[Atom, int]:
    return {k: v for k, v in form.items() if v != 0}


Guard = tuple  # the conditions of the Ifs whose then-branch holds an access

#: the most (work-item, loop repetition) points whose texels `injective` enumerates; beyond, nothing is proved
MAX_POINTS = 1 << 22
#: the work-item ids (axis 0) a texel index may hold
WORK_ITEM_IDS = {"get_global_id": "gid", "get_group_id": "group", "get_local_id": "lid"}
#: comparisons a guard may make (others: assumed true, which only adds points)
COMPARISONS = {"==": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater,
               ">=": np.greater_equal}


def _loop_values(loop: kir.For) -> np.ndarray | None:
    """The values a loop's variable takes, where its bounds are constants."""
    if loop.condition is None and loop.step_op == "+=" and loop.step > 0 and isinstance(loop.start, Const) \
            and isinstance(loop.stop, Const):
        return np.arange(int(loop.start.value), int(loop.stop.value), loop.step, dtype=np.int64)
    return None


def index_bases(form: Affine) -> set[Atom]:
    """The work-item ids and loop variables `form` holds, inside quotients too."""
    found: set[Atom] = set()
    for atom, _ in form:
        found |= index_bases(atom[1]) if atom[0] == "div" else {atom} if atom[0] != "1" else set()
    return found


def _evaluate(form: Affine, values: dict[Atom, np.ndarray]) -> np.ndarray:
    total = np.zeros(1, dtype=np.int64)
    for atom, coefficient in form:
        term = (np.ones(1, dtype=np.int64) if atom[0] == "1" else
                _evaluate(atom[1], values) // atom[2] if atom[0] == "div" else values[atom])
        total = total + coefficient * term
    return total


def _holds(guard: Guard, declared: dict[str, Any], values: dict[Atom, np.ndarray], points: int) -> np.ndarray:
    """Where every condition of `guard` it can evaluate holds (a comparison of two forms of `values`' atoms)."""
    mask = np.ones(points, dtype=bool)
    for condition in guard:
        if isinstance(condition, Binary) and condition.op in COMPARISONS:
            a, b = index_form(condition.a, declared), index_form(condition.b, declared)
            if a is not None and b is not None and (index_bases(a) | index_bases(b)) <= set(values):
                mask &= np.broadcast_to(COMPARISONS[condition.op](_evaluate(a, values), _evaluate(b, values)),
                                        (points,))
    return mask


def injective(form: Affine, declared: dict[str, Any], items: int | None, group_size: int | None,
               guards: Sequence[Guard]) -> bool:
    """Whether the texel index `form` takes different values at every work-item and loop repetition that makes
    an access (its guards hold there): enumerated over the launch's work-items (a kernel returns beyond its
    items, else its outputs would race already) and the loops' values (a loop may break early: more points
    than run, which only makes the proof harder), where they are few enough."""
    bases = sorted(index_bases(form))
    work_items = [b for b in bases if b[0] in WORK_ITEM_IDS.values()]
    if not items or not work_items or any(b[1] != 0 for b in work_items) or \
            (any(b[0] != "gid" for b in work_items) and not group_size):
        return False
    size = -(-items // group_size) * group_size if group_size else items
    loops = [b for b in bases if b[0] == "loop"]
    ranges = [np.arange(size, dtype=np.int64)] + [_loop_values(declared[b[1]]) for b in loops]
    if any(r is None for r in ranges) or float(np.prod([len(r) for r in ranges], dtype=np.float64)) > MAX_POINTS:
        return False
    grids = [g.reshape(-1) for g in np.meshgrid(*ranges, indexing="ij")]
    values = dict(zip(loops, grids[1:]))
    values.update({("gid", 0): grids[0], ("group", 0): grids[0] // (group_size or 1),
                   ("lid", 0): grids[0] % (group_size or 1)})
    points = len(grids[0])
    accessed = np.zeros(points, dtype=bool)
    for guard in guards:
        accessed |= _holds(guard, declared, values, points)
    texels = np.broadcast_to(_evaluate(form, values), (points,))[accessed]
    return _distinct(texels)


def _distinct(values: np.ndarray) -> bool:
    """Whether no two of the integers `values` are equal: counted where they lie in a range about their number
    (a texel index mostly), in linear time, else sorted (np.unique's hashing and sorting took 0.3 CPU s of the 1B
    LoRA step's compile)."""
    if values.size == 0:
        return True
    low, high = int(values.min()), int(values.max())
    if values.dtype.kind in "iu" and high - low < 4 * values.size + 4096:
        return int(np.bincount(values - low if low else values).max()) <= 1
    return len(np.unique(values)) == len(values)
