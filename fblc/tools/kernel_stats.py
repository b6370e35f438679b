"""Figures of a compiled step that a phone's GPU cares about, computed from the kernel IR and the bundle, no GPU.

From the kernel IR of every launch (fblc/codegen/ir; `Program.kernels[*].ir`, which `compile_figures` captures):

- texel fetches and how many of them use every channel of their texel (all four lanes of an RGBA texel; the one
  channel of a mask's r_mask image), the lanes a fetch's readers use as fblc/tools/lane_use.py finds them;
- float arithmetic by scalar type (lane-operations: a float4 add is 4), so the share computed in `half` (or
  `real`, a half kernel's type that is half wherever the device has cl_khr_fp16).

Each figure is given per site (`static`: every Load and every operation of every launch once) and per step
(`runs`). Runs are counted per work-item (item_values.py): an `if` whose condition the kernel's integer prologue
gives (from get_global_id) weighs each branch by the work-items that take it (a conv's per-lane edge path runs at
row ends only), a loop whose start and stop it gives runs each work-item's own trips. Elsewhere (a condition on
data or on a loop variable) an `if` without `else` counts as taken and of an if/else the branch with more work
(both count for `static`), and a loop's trips come from interval bounds of its start and stop
(`max(0, a) .. min(3, b)`: 3; a strided `lid .. n step 64`: n / 64): upper estimates; a loop without bounds
counts once (`unbounded_loops`); `estimated_fetch_runs` are the fetch runs counted under such estimates. Against
oclgrind's image reads of one step (benchmarks/instructions.py prints both): examples/mlp.py +0.2 % (naive) and
+0.6 % (rtile); MobileNetV2 [1,3,32,32] +2.0 % and +6.2 %, within its 0.69M / 0.57M estimated runs.

From the bundle (plan.json, report.json's `estimate`): launches per step, the share of the step's FLOPs in launches
with fewer work-items than the device holds at once (`device_items`), bytes moved and the step estimate.

Used by benchmarks/phone_kernels.py and benchmarks/instructions.py. phone_kernels also runs this module,
lane_use.py and item_values.py against an older fblc, loaded by path: they import only fblc.codegen.ir,
fblc.codegen.compile's `lower` and the profile loader, which every version since the kernel IR (41fc349) has.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Sequence

import numpy as np

from fblc.codegen import ir
from fblc.profiles import Profile
from fblc.profiles.roofline import LaunchWork, launch_time
from fblc.tools.item_values import INTEGERS, Items, Unknown, evaluate, per_item
from fblc.tools.lane_use import (FLOATS, UNBOUNDED, Bounds, Demand, LaneUse, LoadVisitor, bounds, children,
                                  lanes_used, statement_demands, trip_count, var_key)

#: channels of a texel by the Load's texture kind: an r_mask image (kind "uint", read as lane x) holds one
CHANNELS: dict[str, int] = {"uint": 1}
#: bytes of one texel by the C element type of a Load's texture (its format's: bundle_format.BUFFER_C_TYPES);
#: a fetch moves its whole texel whatever lanes its readers use
TEXEL_BYTES: dict[str, int] = {"float4": 16, "int4": 16, "half": 8, "uchar": 1}
#: calls that move lanes, not arithmetic
LANE_MOVES = frozenset({"WINDOW", "window4", "lane_f", "lane_i", "wrap_row"})
CONVERSIONS = ("convert_", "as_")  # type conversions and reinterpretations, not arithmetic
ARITHMETIC = frozenset({"+", "-", "*", "/"})
#: float scalar types that are half on a target with cl_khr_fp16: `half`, and `real`, the type a half kernel
#: computes in where the same source also builds without the extension (then float: a device the target is not)
HALF_TYPES = ("half", "real")


@dataclass
class Figures:
    """Totals over kernels; `*_runs` per step (weighted by work-items and loop trips), the others per site."""

    fetches: int = 0
    whole_fetches: int = 0
    fetch_runs: float = 0.0
    whole_fetch_runs: float = 0.0
    lanes_fetched_runs: float = 0.0  # lanes used, summed over fetch runs
    fetched_bytes_runs: float = 0.0  # bytes of the whole texels fetched, summed over fetch runs
    #: fetch runs counted under upper estimates: an if whose condition depends on data or a loop variable, a loop
    #: whose trips come from interval bounds (the rest are exact for the work-items' prologue values)
    estimated_fetch_runs: float = 0.0
    ops: Counter[str] = field(default_factory=Counter)  # static lane-operations by scalar type
    op_runs: Counter[str] = field(default_factory=Counter)  # per step
    #: lane-operations of products an add or subtract takes as its operand (`acc += a * b`), per step by scalar
    #: type: the two run as one fused multiply-add, so a step's issue slots are op_runs less these
    fused_runs: Counter[str] = field(default_factory=Counter)
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
        """Fraction of float arithmetic (lane-operations) computed in half (HALF_TYPES)."""
        ops = self.op_runs if weighted else self.ops
        total = sum(ops.values())
        return sum(ops[scalar] for scalar in HALF_TYPES) / total if total else 0.0


def _scaled(figures: Figures, factor: float) -> Figures:
    """`figures` with its weighted fields times `factor` (static ones as they are)."""
    return Figures(figures.fetches, figures.whole_fetches, figures.fetch_runs * factor,
                   figures.whole_fetch_runs * factor, figures.lanes_fetched_runs * factor,
                   figures.fetched_bytes_runs * factor, figures.estimated_fetch_runs * factor, Counter(figures.ops),
                   Counter({k: v * factor for k, v in figures.op_runs.items()}),
                   Counter({k: v * factor for k, v in figures.fused_runs.items()}), figures.unbounded_loops)

# one kernel -------------------------------------------------------------------------------------
def kernel_figures(kernel: ir.KernelIR, items: int, group_size: int | None = None) -> Figures:
    """The figures of one launch of `kernel` over `items` work-items (in groups of `group_size` where the
    kernel is written for one: Kernel.group_size)."""
    use = LaneUse(kernel.body)
    walk = _Walk(use, Items(items, group_size), {}, {})
    return _block_figures(kernel.body, walk, per_item(1.0, walk.items), frozenset())


@dataclass
class _Walk:
    """What a kernel's walk knows: its lane use, its work-items, the interval bounds (lane_use.bounds) and the
    per-work-item values (item_values.evaluate) of its int variables by var_key."""

    use: LaneUse
    items: Items
    env: dict[Any, Bounds]
    values: dict[Any, Any]

    def branch(self) -> _Walk:
        return _Walk(self.use, self.items, dict(self.env), dict(self.values))

    def known(self, e: ir.Expr) -> np.ndarray | None:
        """`e`'s value for every work-item, or None where it cannot be known."""
        try:
            return per_item(evaluate(e, self.values, self.items, var_key), self.items)
        except (Unknown, TypeError, ValueError, OverflowError):
            return None


class _Fetches(LoadVisitor):
    """Counts the fetches of one statement, run `weights[i]` times by work-item i, into `figures`."""

    def __init__(self, figures: Figures, walk: _Walk, weights: np.ndarray) -> None:
        self.figures, self.walk, self.weights, self.weight = figures, walk, weights, float(weights.sum())

    def load(self, load: ir.Load, demand: Demand) -> None:
        channels = CHANNELS.get(load.argument.kind, 4)
        lanes, whole = lanes_used(demand, channels)
        runs = self.weight * self.share
        self.figures.fetches += 1
        self.figures.whole_fetches += whole
        self.figures.fetch_runs += runs
        self.figures.whole_fetch_runs += runs * whole
        self.figures.lanes_fetched_runs += runs * lanes * 4 / channels
        self.figures.fetched_bytes_runs += runs * TEXEL_BYTES[load.argument.element]

    def branch_shares(self, select: ir.Select) -> tuple[float, float] | None:
        taken = self.walk.known(select.condition)
        if taken is None or not self.weight:
            return None
        share = float((self.weights * (taken != 0)).sum()) / self.weight
        return share, 1.0 - share


def _expr_figures(e: ir.Expr, demand: Demand, walk: _Walk, weights: np.ndarray, loops: frozenset[Any],
                  figures: Figures) -> None:
    use, weight = walk.use, float(weights.sum())
    on_load = _Fetches(figures, walk, weights)
    use.push(e, demand, loops, on_load)
    pending = [e]
    while pending:  # float arithmetic, skipping the subtrees of index arithmetic
        sub = pending.pop()
        if use.flags(sub) & FLOATS:
            if _is_arithmetic(sub):
                lanes = max(1, sub.dtype.lanes)
                figures.ops[sub.dtype.scalar] += lanes
                figures.op_runs[sub.dtype.scalar] += lanes * weight
                if isinstance(sub, ir.Binary) and sub.op in ("+", "-"):
                    _fuse(figures, next((x for x in (sub.a, sub.b) if _is_product(x)), None), weight)
            pending.extend(children(sub))


def _is_arithmetic(e: ir.Expr) -> bool:
    if not e.dtype.is_float:
        return False
    if isinstance(e, ir.Binary):
        return e.op in ARITHMETIC
    if isinstance(e, ir.Unary):
        return e.op == "-"
    return isinstance(e, ir.Call) and e.function not in LANE_MOVES and not e.function.startswith(CONVERSIONS)


def _is_product(e: ir.Expr) -> bool:
    return isinstance(e, ir.Binary) and e.op == "*" and e.dtype.is_float


def _fuse(figures: Figures, product: ir.Expr | None, weight: float) -> None:
    """Count `product`, an operand of an add, as fused into it (Figures.fused_runs)."""
    if product is not None:
        figures.fused_runs[product.dtype.scalar] += max(1, product.dtype.lanes) * weight


def _returns(block: Sequence[ir.Statement]) -> bool:
    return any(isinstance(s, ir.Return) for s in block)


def _block_figures(body: Sequence[ir.Statement], walk: _Walk, weights: np.ndarray, loops: frozenset[Any]) -> Figures:
    """The figures of `body`, run `weights[i]` times by work-item i."""
    figures, weight = Figures(), float(weights.sum())
    for s in body:
        for expr, demand in statement_demands(s, walk.use):
            _expr_figures(expr, demand, walk, weights, loops, figures)
        if isinstance(s, ir.Assign) and s.op != "=" and s.value.dtype.is_float and s.op[:-1] in ARITHMETIC:
            lanes = max(1, s.value.dtype.lanes)
            figures.ops[s.value.dtype.scalar] += lanes
            figures.op_runs[s.value.dtype.scalar] += lanes * weight
            if s.op in ("+=", "-=") and _is_product(s.value):
                _fuse(figures, s.value, weight)
        if isinstance(s, ir.Declare) and s.const and s.init is not None:
            walk.env[var_key(s.var)] = bounds(s.init, walk.env)
            value = walk.known(s.init) if s.var.dtype.scalar in INTEGERS and s.var.dtype.lanes == 1 else None
            if value is not None:
                walk.values[var_key(s.var)] = value
            else:  # a name declared again (an epilogue's `t` in its tile loop) is no longer the outer one
                walk.values.pop(var_key(s.var), None)
        if isinstance(s, ir.For):
            figures.add(_loop_figures(s, walk, weights, loops))
        elif isinstance(s, ir.While):
            inner = _block_figures(s.body, walk, weights, loops)
            inner.unbounded_loops += 1
            figures.add(inner)
        elif isinstance(s, ir.If):
            taken = walk.known(s.condition)
            if taken is not None:  # each work-item runs the branch its condition picks
                mask = taken != 0
                figures.add(_block_figures(s.then, walk.branch(), weights * mask, loops))
                figures.add(_block_figures(s.orelse, walk.branch(), weights * ~mask, loops))
                if _returns(s.then) or _returns(s.orelse):  # the work-items that returned run nothing after
                    weights = weights * (~mask if _returns(s.then) else mask)
                    weight = float(weights.sum())
                continue
            then = _block_figures(s.then, walk.branch(), weights, loops)
            orelse = _block_figures(s.orelse, walk.branch(), weights, loops)
            heavier, lighter = (then, orelse) if then.weight >= orelse.weight else (orelse, then)
            heavier.estimated_fetch_runs = heavier.fetch_runs
            figures.add(heavier).add(_scaled(lighter, 0.0))  # static sites of both; the runs of one
    return figures


def _loop_figures(loop: ir.For, walk: _Walk, weights: np.ndarray, loops: frozenset[Any]) -> Figures:
    """A loop's figures: its body run each work-item's own trips where its start and stop are known per
    work-item, else the trips of their interval bounds (an upper estimate), else once (`unbounded_loops`)."""
    start, stop = bounds(loop.start, walk.env), bounds(loop.stop, walk.env) if loop.stop is not None else UNBOUNDED
    item_trips: np.ndarray | None = None
    if loop.condition is None and loop.step_op == "+=" and loop.step > 0 and loop.stop is not None:
        first, last = walk.known(loop.start), walk.known(loop.stop)
        if first is not None and last is not None:
            item_trips = np.maximum(0, np.ceil((last - first) / loop.step))
    trips = trip_count(loop, walk.env)
    walk.env[var_key(loop.var)] = (start[0], None if stop[1] is None else stop[1] - 1)
    walk.values.pop(var_key(loop.var), None)
    inner_weights = weights * (item_trips if item_trips is not None else (1 if trips is None else trips))
    inner = _block_figures(loop.body, walk, inner_weights, loops | {var_key(loop.var)})
    inner.unbounded_loops += item_trips is None and trips is None
    if item_trips is None and not (start[0] == start[1] and stop[0] == stop[1] and loop.condition is None):
        inner.estimated_fetch_runs = inner.fetch_runs  # interval bounds (or once): an upper estimate
    return inner


def program_figures(kernels: Iterable[Any]) -> Figures:
    """The figures of a step's launches: objects with `.ir` (KernelIR) and `.global_size` (work-items),
    e.g. `Program.kernels` of fblc.codegen.plan."""
    total = Figures()
    for figures in launch_figures(kernels).values():
        total.add(figures)
    return total


def launch_figures(kernels: Iterable[Any]) -> dict[str, Figures]:
    """Each launch's figures by kernel name (program_figures' kernels)."""
    return {kernel.name: kernel_figures(kernel.ir, kernel.global_size, getattr(kernel, "group_size", None))
            for kernel in kernels}


def launch_estimates(launches: dict[str, Figures], plan: dict[str, Any], estimate: dict[str, Any],
                     profile: Any) -> list[dict[str, Any]]:
    """Each launch's time on `profile` by its roofline (fblc.profiles.roofline) from what its kernel IR runs: its
    lane-operations (wasted lanes included: a float4 add is 4) less the products fused into an add
    (Figures.fused_runs), half ones where their type is half (HALF_TYPES), the whole texels it fetches, its launch
    size from plan.json and its DRAM bytes from report.json's `estimate` (each texture once). One row a launch, in
    launch order: name, family, items, ms, bound and what makes it up (the step estimate's breakdown)."""
    kernels = {k["name"]: k for k in plan["kernels"]}
    dram = {k["kernel"]: k["bytes"] for k in estimate["kernels"]}
    rows = []
    for name, figures in launches.items():
        kernel = kernels[name]
        slots = figures.op_runs - figures.fused_runs  # a fused multiply-add issues once
        half = sum(slots[scalar] for scalar in HALF_TYPES)
        time = launch_time(profile, LaunchWork(kernel["items"], kernel["global_size"][0], kernel["local_size"][0],
                                               sum(slots.values()) - half, half, figures.fetched_bytes_runs,
                                               dram.get(name, 0)))
        rows.append({"kernel": name, "family": kernel.get("family", ""), "items": kernel["items"], "ms": time.ms,
                     "bound": time.bound, "slots": float(sum(slots.values())),
                     "fetched_bytes": float(figures.fetched_bytes_runs), "dram_bytes": dram.get(name, 0),
                     "lanes": time.lane_share})
    return rows


def ir_estimate(launches: dict[str, Figures], plan: dict[str, Any], estimate: dict[str, Any],
                profile: Any) -> dict[str, Any]:
    """The step's time on `profile` from what each launch's kernel IR runs (launch_estimates' sum): gives
    `ir_step_ms`, the launches each bound counts (`ir_bounds`) and the launches themselves (`ir_kernels`)."""
    rows = launch_estimates(launches, plan, estimate, profile)
    return {"ir_step_ms": sum(row["ms"] for row in rows), "ir_bounds": dict(Counter(row["bound"] for row in rows)),
            "ir_kernels": rows}


# the bundle -------------------------------------------------------------------------------------
def device_items(profile: Profile) -> tuple[int, str]:
    """(work-items the device holds at once: Profile.device_items, how the profile makes it up)."""
    return profile.device_items, f"profile ({profile.compute_units} units x {profile.waves_per_unit} waves x " \
                                 f"{profile.wave_size})"


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
                    resident_items: int | None = None, profile: Any = None, co_launched_kernels: bool = True
                    ) -> tuple[Figures, dict[str, Any]]:
    """Compile `model_path` into `bundle` for `target` and give (the kernels' Figures, bundle_figures with
    `device_items` and `device_items_from`). `options`: TrainingOptions (default: fblc compile's);
    `resident_items`: the device's size to count small launches against (default: device_items of the
    target's profile as this fblc has it; give one to compare two versions of fblc alike); `profile`: the
    figures ir_estimate takes (default: the target's profile; give one to compare two versions alike);
    `co_launched_kernels=False`: every kernel its own launch (codegen/co_launch.py off)."""
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
        # named only when off: a --base tree of fblc from before co-launch has no such argument
        compile_module.compile_model(model_path, bundle, target, dtype, options or TrainingOptions(),
                                     **({} if co_launched_kernels else {"co_launched_kernels": False}))
    finally:
        compile_module.lower = lower  # type: ignore[assignment]
    resident, how = device_items(load_profile(target)) if resident_items is None else (resident_items, "given")
    launches = launch_figures(programs[-1].kernels)
    with open(os.path.join(bundle, "plan.json")) as handle:
        plan = json.load(handle)
    with open(os.path.join(bundle, "report.json")) as handle:
        estimate = ir_estimate(launches, plan, json.load(handle)["estimate"], profile or load_profile(target))
    total = Figures()
    for figures in launches.values():
        total.add(figures)
    return total, {**bundle_figures(bundle, resident), **estimate, "device_items": resident,
                   "device_items_from": how}
