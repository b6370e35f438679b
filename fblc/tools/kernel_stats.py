"""Figures of a compiled step that a phone's GPU cares about, computed from the kernel IR and the bundle, no GPU.

From the kernel IR of every launch (fblc/codegen/ir; `Program.kernels[*].ir`, which `compile_figures` captures):

- texel fetches and how many of them use every channel of their texel (all four lanes of an RGBA texel; the one
  channel of a mask's r_mask image). A fetch's used lanes follow its value through the IR: `v.x` uses lane 0, a
  swizzle its lanes, vector arithmetic and stores every lane, a value kept in a variable or array what its readers
  use (to a fixed point), a lane picked at run time one lane (all four when the picking loop runs inside the
  variable's scope over >= 4 lanes), a `window4`/`WINDOW` operand the lanes its shift selects (a texel that is the
  second operand of one window and the first of the next with the same shift: all four; one side alone: fewer);
- float arithmetic by scalar type (lane-operations: a float4 add is 4), so the share computed in `half`.

Each figure is given per site (`static`: every Load and every operation of every launch once) and per step
(`runs`: times work-items times the trip counts of the loops around it). Trip counts come from interval bounds of
a loop's start and stop (`max(0, a) .. min(3, b)`: at most 3; a strided `lid .. n step 64`: n / 64); a loop
without bounds counts once and is counted in `unbounded_loops`. An `if` without `else` counts as taken; of an
if/else, the branch with more weighted work counts (a work-item runs one), both count for `static`.

From the bundle (plan.json, report.json's `estimate`): launches per step, the share of the step's FLOPs in launches
with fewer work-items than the device holds at once (`device_items`), bytes moved and the step estimate.

Used by benchmarks/phone_kernels.py (which also runs this file against an older fblc, loaded by path: it imports
only fblc.codegen.ir and the profile loader, which every version since the kernel IR has).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

from fblc.codegen import ir

#: channels of a texel by the Load's texture kind: an r_mask image (kind "uint", read as lane x) holds one
CHANNELS: dict[str, int] = {"uint": 1}
#: calls that move lanes, not arithmetic
LANE_MOVES = frozenset({"WINDOW", "window4", "lane_f", "lane_i", "wrap_row"})
WINDOWS = frozenset({"WINDOW", "window4"})
CONVERSIONS = ("convert_", "as_")  # type conversions and reinterpretations, not arithmetic
ARITHMETIC = frozenset({"+", "-", "*", "/"})
#: device size when the profile has no compute_units / waves_per_unit (estimated: issue 39's reading of
#: adreno830, 6 shader processors of 4 resident 64-wide waves, 1536 work-items; applied to every target)
FALLBACK_COMPUTE_UNITS = 6
FALLBACK_WAVES_PER_UNIT = 4
UNBOUNDED = (None, None)

def _key(var: ir.Var) -> Any:
    """A variable's identity: its C name (an emitter may build a fixed-name variable, `lane`, more than once)."""
    return var.name or (var.kind, var.number)


Demand = frozenset  # of lane numbers, "dyn" (one lane chosen at run time), ("wf"|"ws", shift) window operands


@dataclass
class Figures:
    """Totals over kernels; `*_runs` per step (weighted by work-items and loop trips), the others per site."""

    fetches: int = 0
    whole_fetches: int = 0
    fetch_runs: float = 0.0
    whole_fetch_runs: float = 0.0
    lanes_fetched_runs: float = 0.0  # lanes used, summed over fetch runs
    ops: Counter[str] = field(default_factory=Counter)  # static lane-operations by scalar type
    op_runs: Counter[str] = field(default_factory=Counter)  # per step
    unbounded_loops: int = 0

    def add(self, other: Figures) -> Figures:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, mine + theirs)
        return self

    @property
    def weight(self) -> float:
        return self.fetch_runs + sum(self.op_runs.values())

    def whole_share(self, weighted: bool) -> float:
        """Fraction of texel fetches that use their whole texel (1.0 with no fetches)."""
        whole, every = (self.whole_fetch_runs, self.fetch_runs) if weighted else (self.whole_fetches, self.fetches)
        return whole / every if every else 1.0

    def half_share(self, weighted: bool = True) -> float:
        """Fraction of float arithmetic (lane-operations) computed in half."""
        ops = self.op_runs if weighted else self.ops
        total = ops["half"] + ops["float"]
        return ops["half"] / total if total else 0.0


def _scaled(figures: Figures, factor: float) -> Figures:
    """`figures` with its weighted fields times `factor` (static ones as they are)."""
    return Figures(figures.fetches, figures.whole_fetches, figures.fetch_runs * factor,
                   figures.whole_fetch_runs * factor, figures.lanes_fetched_runs * factor, Counter(figures.ops),
                   Counter({k: v * factor for k, v in figures.op_runs.items()}), figures.unbounded_loops)


# interval bounds of int expressions --------------------------------------------------------------
Bounds = tuple  # (lo, hi), either None where unknown


def _bounds(e: ir.Expr, env: dict[Any, Bounds]) -> Bounds:
    if isinstance(e, ir.Const):
        return (e.value, e.value) if isinstance(e.value, (int, float)) else UNBOUNDED
    if isinstance(e, ir.Var):
        return env.get(_key(e), UNBOUNDED)
    if isinstance(e, ir.Cast):
        return _bounds(e.a, env)
    if isinstance(e, ir.Select):
        a, b = _bounds(e.if_true, env), _bounds(e.if_false, env)
        return (_pick(min, a[0], b[0]), _pick(max, a[1], b[1]))
    if isinstance(e, ir.Call):
        args = [_bounds(a, env) for a in e.args]
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
        a, b = _bounds(e.a, env), _bounds(e.b, env)
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
    start = _bounds(loop.start, env)
    if loop.condition is None and loop.step_op == "+=" and loop.step > 0:
        stop = _bounds(loop.stop, env) if loop.stop is not None else UNBOUNDED
        if start[0] is None or stop[1] is None:
            return None
        return max(0, math.ceil((stop[1] - start[0]) / loop.step))
    condition = loop.condition
    if not (isinstance(condition, ir.Binary) and isinstance(condition.a, ir.Var) and _key(condition.a) == _key(loop.var) and condition.op in COMPARE):
        return None
    limit = _bounds(condition.b, env)
    value = start[1] if loop.step_op in (">>=", "-=") else start[0]
    bound = limit[0] if condition.op in (">", ">=") else limit[1]
    if value is None or bound is None or loop.step_op not in STEPS:
        return None
    trips = 0
    while COMPARE[condition.op](value, bound) and trips < 1 << 20:  # a few steps for the loops kernels write
        value, trips = STEPS[loop.step_op](value, loop.step), trips + 1
    return trips if trips < 1 << 20 else None


# which lanes of each value its readers use ---------------------------------------------------------
def _children(e: ir.Expr) -> Iterable[ir.Expr]:
    for value in vars(e).values():
        if isinstance(value, ir.Expr):
            yield value
        elif isinstance(value, tuple):
            yield from (v for v in value if isinstance(v, ir.Expr))


def _all(e: ir.Expr) -> Demand:
    return frozenset(range(max(1, e.dtype.lanes)))


class LaneUse:
    """The lanes of every variable its readers use, for one kernel (to a fixed point over its statements)."""

    def __init__(self, body: Sequence[ir.Statement]) -> None:
        self.body = body
        self.demand: dict[Any, Demand] = {}  # by _key
        self.declared_in: dict[Any, frozenset[Any]] = {}  # the loops around a variable's declaration
        self.trips: dict[Any, int | None] = {}  # loop variable -> its loop's trips
        self.inits: dict[Any, ir.Expr] = {}  # const variable -> its value
        self.changed = True
        while self.changed:
            self.changed = False
            self._statements(body, frozenset(), {})

    def of(self, var: ir.Var) -> Demand:
        return self.demand.get(_key(var), frozenset())

    def _note(self, var: ir.Var, demand: Demand) -> None:
        key = _key(var)
        if not demand <= self.demand.get(key, frozenset()):
            self.demand[key] = self.demand.get(key, frozenset()) | demand
            self.changed = True

    def _statements(self, body: Sequence[ir.Statement], loops: frozenset[Any], env: dict[Any, Bounds]) -> None:
        for s in body:
            for expr, demand in statement_demands(s, self):
                self.push(expr, demand, loops)
            if isinstance(s, (ir.Declare, ir.DeclareArray)):
                self.declared_in.setdefault(_key(s.var), loops)
            if isinstance(s, ir.Declare) and s.const and s.init is not None:
                env[_key(s.var)] = _bounds(s.init, env)
                self.inits[_key(s.var)] = s.init
            if isinstance(s, ir.For):
                self.trips[_key(s.var)] = trip_count(s, env)
                start, stop = _bounds(s.start, env), _bounds(s.stop, env) if s.stop is not None else UNBOUNDED
                env[_key(s.var)] = (start[0], None if stop[1] is None else stop[1] - 1)
                self._statements(s.body, loops | {_key(s.var)}, env)
            else:
                for block in ir.nested(s):
                    self._statements(block, loops, env)

    def push(self, e: ir.Expr, demand: Demand, loops: frozenset[Any],
             on_load: Callable[[ir.Load, Demand], None] | None = None) -> None:
        """Hand `demand` (lanes of `e` its reader uses) down `e`; `on_load` sees each Load with its demand."""
        if isinstance(e, ir.Load):
            if on_load is not None:
                on_load(e, demand)
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
        for child in _children(e):
            # lane-wise: a vector operand gives the lanes its result's reader uses; a scalar, or a vector that a
            # scalar is computed from (dot, a comparison's condition), all of its lanes
            same = child.dtype.lanes == e.dtype.lanes and child.dtype.lanes > 1 and not isinstance(e, ir.ArgumentRef)
            self.push(child, demand if same else _all(child), loops, on_load)

    def _dynamic_lane(self, e: ir.Lane, loops: frozenset[Any]) -> Demand:
        """A lane picked at run time: every lane when a loop inside the vector's scope runs over >= its lanes
        (`for lane < 4: lane_f(v, lane)`), else one lane."""
        scope = self.declared_in.get(_key(e.vector), frozenset()) if isinstance(e.vector, ir.Var) else loops
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
                key = _key(sub)
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
        if isinstance(target, ir.Var):
            wanted = use.of(target)
        elif isinstance(target, ir.Element):
            wanted = use.of(target.array)
        else:  # a lane of a vector variable: a scalar
            wanted = frozenset({0})
        reads = [(s.value, wanted)]
        if isinstance(target, ir.Element):
            reads.append((target.index, frozenset({0})))
        return reads
    return [(e, _all(e)) for e in ir.statement_exprs(s)]


def _lanes_used(demand: Demand, channels: int) -> tuple[int, bool]:
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


# one kernel -------------------------------------------------------------------------------------
def kernel_figures(kernel: ir.KernelIR, items: int) -> Figures:
    """The figures of one launch of `kernel` over `items` work-items."""
    use = LaneUse(kernel.body)
    return _block_figures(kernel.body, use, float(max(items, 1)), frozenset(), {})


def _expr_figures(e: ir.Expr, demand: Demand, use: LaneUse, weight: float, loops: frozenset[Any],
                  figures: Figures) -> None:
    def on_load(load: ir.Load, wanted: Demand) -> None:
        channels = CHANNELS.get(load.argument.kind, 4)
        lanes, whole = _lanes_used(wanted, channels)
        figures.fetches += 1
        figures.whole_fetches += whole
        figures.fetch_runs += weight
        figures.whole_fetch_runs += weight * whole
        figures.lanes_fetched_runs += weight * lanes * 4 / channels

    use.push(e, demand, loops, on_load)
    for sub in ir.walk_expr(e):
        if _is_arithmetic(sub):
            lanes = max(1, sub.dtype.lanes)
            figures.ops[sub.dtype.scalar] += lanes
            figures.op_runs[sub.dtype.scalar] += lanes * weight


def _is_arithmetic(e: ir.Expr) -> bool:
    if not e.dtype.is_float:
        return False
    if isinstance(e, ir.Binary):
        return e.op in ARITHMETIC
    if isinstance(e, ir.Unary):
        return e.op == "-"
    return isinstance(e, ir.Call) and e.function not in LANE_MOVES and not e.function.startswith(CONVERSIONS)


def _block_figures(body: Sequence[ir.Statement], use: LaneUse, weight: float, loops: frozenset[Any],
                   env: dict[Any, Bounds]) -> Figures:
    figures = Figures()
    for s in body:
        for expr, demand in statement_demands(s, use):
            _expr_figures(expr, demand, use, weight, loops, figures)
        if isinstance(s, ir.Assign) and s.op != "=" and s.value.dtype.is_float and s.op[:-1] in ARITHMETIC:
            lanes = max(1, s.value.dtype.lanes)
            figures.ops[s.value.dtype.scalar] += lanes
            figures.op_runs[s.value.dtype.scalar] += lanes * weight
        if isinstance(s, ir.Declare) and s.const and s.init is not None:
            env[_key(s.var)] = _bounds(s.init, env)
        if isinstance(s, ir.For):
            trips = trip_count(s, env)
            start, stop = _bounds(s.start, env), _bounds(s.stop, env) if s.stop is not None else UNBOUNDED
            env[_key(s.var)] = (start[0], None if stop[1] is None else stop[1] - 1)
            inner = _block_figures(s.body, use, weight * (1 if trips is None else trips), loops | {_key(s.var)}, env)
            inner.unbounded_loops += trips is None
            figures.add(inner)
        elif isinstance(s, ir.While):
            inner = _block_figures(s.body, use, weight, loops, env)
            inner.unbounded_loops += 1
            figures.add(inner)
        elif isinstance(s, ir.If):
            then = _block_figures(s.then, use, weight, loops, dict(env))
            orelse = _block_figures(s.orelse, use, weight, loops, dict(env))
            heavier, lighter = (then, orelse) if then.weight >= orelse.weight else (orelse, then)
            figures.add(heavier).add(_scaled(lighter, 0.0))  # static sites of both; the runs of one
    return figures


def program_figures(kernels: Iterable[Any]) -> Figures:
    """The figures of a step's launches: objects with `.ir` (KernelIR) and `.global_size` (work-items),
    e.g. `Program.kernels` of fblc.codegen.plan."""
    total = Figures()
    for kernel in kernels:
        total.add(kernel_figures(kernel.ir, kernel.global_size))
    return total


# the bundle -------------------------------------------------------------------------------------
def device_items(profile: Any) -> tuple[int, str]:
    """(work-items the device holds at once, how that was found): compute_units x waves_per_unit x wave_size
    from the profile, or this module's estimate where the profile has no such figure."""
    units, waves = getattr(profile, "compute_units", None), getattr(profile, "waves_per_unit", None)
    how = f"profile ({units} units x {waves} waves x {profile.wave_size})"
    if not units or not waves:
        units, waves = units or FALLBACK_COMPUTE_UNITS, waves or FALLBACK_WAVES_PER_UNIT
        how = f"estimated ({units} units x {waves} waves; the profile has no compute_units/waves_per_unit)"
    return int(units) * int(waves) * int(profile.wave_size), how


def bundle_figures(bundle: str, resident_items: int) -> dict[str, Any]:
    """Launches per step, the share of FLOPs in launches of fewer work-items than `resident_items`, bytes
    moved per step and the step estimate, from `bundle`'s plan.json and report.json."""
    with open(os.path.join(bundle, "plan.json")) as handle:
        plan = json.load(handle)
    with open(os.path.join(bundle, "report.json")) as handle:
        estimate = json.load(handle)["estimate"]
    items = {k["name"]: k["items"] for k in plan["kernels"]}
    flops = {k["kernel"]: k["flops"] for k in estimate["kernels"]}
    small = sum(f for name, f in flops.items() if items.get(name, 0) < resident_items)
    return {"launches": len(plan["kernels"]),
            "small_launches": sum(1 for n in items.values() if n < resident_items),
            "small_flop_share": small / sum(flops.values()) if sum(flops.values()) else 0.0,
            "bytes": estimate["bytes"], "step_ms": estimate["step_ms"], "flops": estimate["flops"]}


def compile_figures(model_path: str, bundle: str, target: str, dtype: str = "fp32", options: Any = None,
                    resident_items: int | None = None) -> tuple[Figures, dict[str, Any]]:
    """Compile `model_path` into `bundle` for `target` and give (the kernels' Figures, bundle_figures with
    `device_items` and `device_items_from`). `options`: TrainingOptions (default: fblc compile's);
    `resident_items`: the device's size to count small launches against (default: device_items of the
    target's profile as this fblc has it; give one to compare two versions of fblc alike)."""
    import fblc.codegen.compile as compile_module
    from fblc.passes.pipeline import TrainingOptions
    from fblc.profiles import load_profile

    programs: list[Any] = []
    lower = compile_module.lower

    def capturing(*args: Any, **kwargs: Any) -> Any:
        programs.append(lower(*args, **kwargs))
        return programs[-1]

    compile_module.lower = capturing  # type: ignore[assignment]
    try:
        compile_module.compile_model(model_path, bundle, target, dtype, options or TrainingOptions())
    finally:
        compile_module.lower = lower  # type: ignore[assignment]
    resident, how = device_items(load_profile(target)) if resident_items is None else (resident_items, "given")
    return program_figures(programs[-1].kernels), {**bundle_figures(bundle, resident), "device_items": resident,
                                                   "device_items_from": how}
