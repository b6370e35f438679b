"""Which lanes of each texel fetch a kernel uses, and how often each statement runs: read from the kernel IR.

`LaneUse` follows every value through a kernel's IR (fblc/codegen/ir) to what reads it: `v.x` uses lane 0, a
swizzle its lanes, vector arithmetic and stores every lane, a value kept in a variable or array what its readers
use (to a fixed point), a lane picked at run time one lane (every lane when the picking loop runs inside the
variable's scope over as many trips as the vector has lanes), a `window4`/`WINDOW` operand the lanes its shift
selects (a texel that is the second operand of one window and the first of the next at the same shift: all;
one side alone: fewer). `trip_count` bounds a loop's trips by interval arithmetic on its start and stop.
fblc/tools/kernel_stats.py counts with both.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

from fblc.codegen import ir

WINDOWS = frozenset({"WINDOW", "window4"})
VECTORS, FLOATS = 1, 2  # LaneUse.flags
UNBOUNDED = (None, None)


def var_key(var: ir.Var) -> Any:
    """A variable's identity: its C name (an emitter may build a fixed-name variable, `lane`, more than once)."""
    return var.name or (var.kind, var.number)


Demand = frozenset  # of lane numbers, "dyn" (one lane chosen at run time), ("wf"|"ws", shift) window operands


# interval bounds of int expressions --------------------------------------------------------------
Bounds = tuple  # (lo, hi), either None where unknown


def bounds(e: ir.Expr, env: dict[Any, Bounds]) -> Bounds:
    if isinstance(e, ir.Const):
        return (e.value, e.value) if isinstance(e.value, (int, float)) else UNBOUNDED
    if isinstance(e, ir.Var):
        return env.get(var_key(e), UNBOUNDED)
    if isinstance(e, ir.Cast):
        return bounds(e.a, env)
    if isinstance(e, ir.Select):
        a, b = bounds(e.if_true, env), bounds(e.if_false, env)
        return (_pick(min, a[0], b[0]), _pick(max, a[1], b[1]))
    if isinstance(e, ir.Call):
        args = [bounds(a, env) for a in e.args]
        if e.function in ("min", "max") and len(args) == 2:
            pick = min if e.function == "min" else max
            lo = pick(args[0][0], args[1][0]) if None not in (args[0][0], args[1][0]) else (
                _known(args[0][0], args[1][0]) if pick is max else None)
            hi = pick(args[0][1], args[1][1]) if None not in (args[0][1], args[1][1]) else (
                _known(args[0][1], args[1][1]) if pick is min else None)
            return (lo, hi)
        if e.function == "clamp" and len(args) == 3:
            return (args[1][0], args[2][1])
        if e.function in ("get_global_id", "get_local_id", "get_group_id"):
            return (0, None)
        return UNBOUNDED
    if isinstance(e, ir.Binary):
        a, b = bounds(e.a, env), bounds(e.b, env)
        if e.op == "+":
            return (_sum(a[0], b[0]), _sum(a[1], b[1]))
        if e.op == "-":
            return (_sum(a[0], _neg(b[1])), _sum(a[1], _neg(b[0])))
        if e.op == "*" and None not in a + b:
            products = [x * y for x in a for y in b]
            return (min(products), max(products))
        if e.op in (">>", "/") and b[0] == b[1] and b[0] is not None and b[0] > 0 and a[0] is not None and a[0] >= 0:
            shift = (lambda v: v >> int(b[0])) if e.op == ">>" else (lambda v: v // b[0])
            return (shift(a[0]), None if a[1] is None else shift(a[1]))
        if e.op == "&" and b[0] == b[1] and isinstance(b[0], int) and b[0] >= 0:
            return (0, b[0])
    return UNBOUNDED


def _pick(choose: Callable[..., Any], a: Any, b: Any) -> Any:
    return None if a is None or b is None else choose(a, b)


def _known(a: Any, b: Any) -> Any:
    return a if b is None else b


def _sum(a: Any, b: Any) -> Any:
    return None if a is None or b is None else a + b


def _neg(a: Any) -> Any:
    return None if a is None else -a


STEPS: dict[str, Callable[[int, int], int]] = {"+=": lambda v, s: v + s, "-=": lambda v, s: v - s,
                                               ">>=": lambda v, s: v >> s, "<<=": lambda v, s: v << s,
                                               "*=": lambda v, s: v * s}
COMPARE: dict[str, Callable[[int, int], bool]] = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
                                                  ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
                                                  "!=": lambda a, b: a != b}


def trip_count(loop: ir.For, env: dict[Any, Bounds]) -> int | None:
    """An upper estimate of a loop's trips from the bounds of its start and stop, or None: unknown."""
    start = bounds(loop.start, env)
    if loop.condition is None and loop.step_op == "+=" and loop.step > 0:
        stop = bounds(loop.stop, env) if loop.stop is not None else UNBOUNDED
        if start[0] is None or stop[1] is None:
            return None
        return max(0, math.ceil((stop[1] - start[0]) / loop.step))
    condition = loop.condition
    if not (isinstance(condition, ir.Binary) and isinstance(condition.a, ir.Var) and var_key(condition.a) == var_key(loop.var) and condition.op in COMPARE):
        return None
    limit = bounds(condition.b, env)
    value = start[1] if loop.step_op in (">>=", "-=") else start[0]
    bound = limit[0] if condition.op in (">", ">=") else limit[1]
    if value is None or bound is None or loop.step_op not in STEPS:
        return None
    trips = 0
    while COMPARE[condition.op](value, bound) and trips < 1 << 20:  # a few steps for the loops kernels write
        value, trips = STEPS[loop.step_op](value, loop.step), trips + 1
    return trips if trips < 1 << 20 else None


# which lanes of each value its readers use ---------------------------------------------------------
def children(e: ir.Expr) -> Iterable[ir.Expr]:
    for value in vars(e).values():
        if isinstance(value, ir.Expr):
            yield value
        elif isinstance(value, tuple):
            yield from (v for v in value if isinstance(v, ir.Expr))


def _all(e: ir.Expr) -> Demand:
    return frozenset(range(max(1, e.dtype.lanes)))


class LoadVisitor:
    """What LaneUse.push reports the fetches it meets to: each Load with the lanes its readers use, at `share` of
    its statement's runs (a Load in one branch of a `?:` runs where that branch is taken: `branch_shares`)."""

    share: float = 1.0

    def load(self, load: ir.Load, demand: Demand) -> None:
        raise NotImplementedError

    def branch_shares(self, select: ir.Select) -> tuple[float, float] | None:
        """The shares of runs that take `select`'s true and false branches, or None: unknown (both counted)."""
        return None


class LaneUse:
    """The lanes of every variable its readers use, for one kernel (to a fixed point over its statements)."""

    def __init__(self, body: Sequence[ir.Statement]) -> None:
        self.body = body
        self.demand: dict[Any, Demand] = {}  # by _key
        self.declared_in: dict[Any, frozenset[Any]] = {}  # the loops around a variable's declaration
        self.trips: dict[Any, int | None] = {}  # loop variable -> its loop's trips
        self.inits: dict[Any, ir.Expr] = {}  # const variable -> its value
        self._flags: dict[int, int] = {}  # id(expression) -> VECTORS | FLOATS of its subtree
        self.changed = True
        while self.changed:
            self.changed = False
            self._statements(body, frozenset(), {})

    def flags(self, e: ir.Expr) -> int:
        """VECTORS where `e`'s subtree reads a texel or a vector variable (its lanes matter), FLOATS where it
        holds a float value (arithmetic to count); neither for index arithmetic, which is most of a kernel."""
        found = self._flags.get(id(e))
        if found is None:
            found = (VECTORS if isinstance(e, ir.Load) or (isinstance(e, (ir.Var, ir.Element)) and e.dtype.lanes > 1)
                     else 0) | (FLOATS if e.dtype.is_float else 0)
            for child in children(e):
                found |= self.flags(child)
            self._flags[id(e)] = found
        return found

    def of(self, var: ir.Var) -> Demand:
        """The lanes of `var` its readers use (a scalar's one lane: what it holds is read, and scalar readers
        are not followed, see flags)."""
        if var.dtype.lanes <= 1:
            return frozenset({0})
        return self.demand.get(var_key(var), frozenset())

    def _note(self, var: ir.Var, demand: Demand) -> None:
        key = var_key(var)
        if not demand <= self.demand.get(key, frozenset()):
            self.demand[key] = self.demand.get(key, frozenset()) | demand
            self.changed = True

    def _statements(self, body: Sequence[ir.Statement], loops: frozenset[Any], env: dict[Any, Bounds]) -> None:
        for s in body:
            for expr, demand in statement_demands(s, self):
                self.push(expr, demand, loops)
            if isinstance(s, (ir.Declare, ir.DeclareArray)):
                self.declared_in.setdefault(var_key(s.var), loops)
            if isinstance(s, ir.Declare) and s.const and s.init is not None:
                env[var_key(s.var)] = bounds(s.init, env)
                self.inits[var_key(s.var)] = s.init
            if isinstance(s, ir.For):
                self.trips[var_key(s.var)] = trip_count(s, env)
                start, stop = bounds(s.start, env), bounds(s.stop, env) if s.stop is not None else UNBOUNDED
                env[var_key(s.var)] = (start[0], None if stop[1] is None else stop[1] - 1)
                self._statements(s.body, loops | {var_key(s.var)}, env)
            else:
                for block in ir.nested(s):
                    self._statements(block, loops, env)

    def push(self, e: ir.Expr, demand: Demand, loops: frozenset[Any], on_load: LoadVisitor | None = None) -> None:
        """Hand `demand` (lanes of `e` its reader uses) down `e`; `on_load` sees each Load with its demand."""
        if not self.flags(e) & VECTORS:  # no texel and no vector below: scalar demands decide no fetch's lanes
            return
        if isinstance(e, ir.Load):
            if on_load is not None:
                on_load.load(e, demand)
            self.push(e.texel, frozenset({0}), loops, on_load)
            return
        if isinstance(e, ir.Var):
            self._note(e, demand)
            return
        if isinstance(e, ir.Element):
            self._note(e.array, demand)
            self.push(e.index, frozenset({0}), loops, on_load)
            return
        if isinstance(e, ir.Lane):
            if isinstance(e.index, ir.Const):
                lanes = frozenset({int(e.index.value)})
            else:
                lanes = self._dynamic_lane(e, loops)
            self.push(e.vector, lanes, loops, on_load)
            self.push(e.index, frozenset({0}), loops, on_load)
            return
        if isinstance(e, ir.Swizzle):
            self.push(e.vector, frozenset(e.first + lane for lane in demand if isinstance(lane, int)), loops, on_load)
            return
        if isinstance(e, ir.Vector):
            offset = 0
            for part in e.parts:
                width = max(1, part.dtype.lanes)
                self.push(part, frozenset(lane - offset for lane in demand
                                          if isinstance(lane, int) and offset <= lane < offset + width), loops, on_load)
                offset += width
            return
        if isinstance(e, ir.Select) and on_load is not None:  # a ?: evaluates one branch: each at its share
            self.push(e.condition, _all(e.condition), loops, on_load)
            shares, outer = on_load.branch_shares(e), on_load.share
            for branch, share in zip((e.if_true, e.if_false), shares or (1.0, 1.0)):
                on_load.share = outer * share
                self.push(branch, demand, loops, on_load)
            on_load.share = outer
            return
        if isinstance(e, ir.Call) and e.function in WINDOWS:
            operands = e.args[1:] if e.function == "WINDOW" else e.args
            first, second, shift = operands[0], operands[1], operands[-1]
            if isinstance(shift, ir.Const):
                s = int(shift.value)
                lanes = [lane for lane in demand if isinstance(lane, int)]
                first_lanes = frozenset(s + lane for lane in lanes if s + lane < 4)
                second_lanes = frozenset(s + lane - 4 for lane in lanes if s + lane >= 4)
            else:
                first_lanes, second_lanes = frozenset({("wf", shift)}), frozenset({("ws", shift)})
            self.push(first, first_lanes, loops, on_load)
            self.push(second, second_lanes, loops, on_load)
            for other in e.args:
                if other is not first and other is not second:
                    self.push(other, _all(other), loops, on_load)
            return
        for child in children(e):
            # lane-wise: a vector operand gives the lanes its result's reader uses; a scalar, or a vector that a
            # scalar is computed from (dot, a comparison's condition), all of its lanes
            same = child.dtype.lanes == e.dtype.lanes and child.dtype.lanes > 1 and not isinstance(e, ir.ArgumentRef)
            self.push(child, demand if same else _all(child), loops, on_load)

    def _dynamic_lane(self, e: ir.Lane, loops: frozenset[Any]) -> Demand:
        """A lane picked at run time: every lane when a loop inside the vector's scope runs over >= its lanes
        (`for lane < 4: lane_f(v, lane)`), else one lane."""
        scope = self.declared_in.get(var_key(e.vector), frozenset()) if isinstance(e.vector, ir.Var) else loops
        lanes = max(1, e.vector.dtype.lanes)
        for loop in self._loops_in(e.index, 8):
            if loop not in scope and (self.trips[loop] or 0) >= lanes:
                return frozenset(range(lanes))
        return frozenset({"dyn"})

    def _loops_in(self, e: ir.Expr, depth: int) -> set[Any]:
        """The loop variables `e` depends on, through const variables' values up to `depth` deep."""
        found = set()
        for sub in ir.walk_expr(e):
            if isinstance(sub, ir.Var):
                key = var_key(sub)
                if key in self.trips:
                    found.add(key)
                elif key in self.inits and depth > 0:
                    found |= self._loops_in(self.inits[key], depth - 1)
        return found


def statement_demands(s: ir.Statement, use: LaneUse) -> list[tuple[ir.Expr, Demand]]:
    """The expressions a statement reads with the lanes of each that it uses."""
    if isinstance(s, ir.Declare):
        return [(s.init, use.of(s.var))] if s.init is not None else []
    if isinstance(s, ir.DeclareArray):
        pairs = [(v, use.of(s.var)) for v in s.init]
        return pairs + ([(s.length, frozenset({0}))] if isinstance(s.length, ir.Expr) else [])
    if isinstance(s, ir.Assign):
        target = s.target
        reads = [(s.value, _wanted(target, use))]
        for written in (target.plain, target.staged) if isinstance(target, ir.StagedChoice) else (target,):
            if isinstance(written, ir.Element):
                reads.append((written.index, frozenset({0})))
        return reads
    return [(e, _all(e)) for e in ir.statement_exprs(s)]


def _wanted(target: ir.Expr, use: LaneUse) -> Demand:
    """The lanes of an assignment's value that the readers of its `target` use (a storage's choice of targets,
    ir.StagedChoice: both's)."""
    if isinstance(target, ir.Var):
        return use.of(target)
    if isinstance(target, ir.Element):
        return use.of(target.array)
    if isinstance(target, ir.StagedChoice):
        return _wanted(target.plain, use) | _wanted(target.staged, use)
    return frozenset({0})  # a lane of a vector variable: a scalar


def lanes_used(demand: Demand, channels: int) -> tuple[int, bool]:
    """(lanes of a fetch its readers use, whether that is the whole texel)."""
    lanes = {lane for lane in demand if isinstance(lane, int) and lane < channels}
    windows = [item for item in demand if isinstance(item, tuple)]
    shifts_first = {shift for kind, shift in windows if kind == "wf"}
    shifts_second = {shift for kind, shift in windows if kind == "ws"}
    if shifts_first & shifts_second:  # the second texel of one window and the first of the next: every lane
        return channels, True
    if windows:
        # one side of windows at an unknown shift s: lanes s..3 or 0..s-1, on average half of the texel
        lanes |= set(range(max(1, channels // 2)))
    used = len(lanes) + (1 if "dyn" in demand and len(lanes) < channels else 0)
    return min(used, channels), min(used, channels) == channels
