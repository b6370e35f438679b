"""Lanes used per texel fetch in a compiled training step, by family, kernel category and operand (issue 39 item 1).

    python -m benchmarks.texel_lanes MODEL.onnx [--target adreno830] [--top 12] [--detail k58_Conv,...]

Reads the kernel IR (no bundle, no device). A fetch (a Load) uses: lane k where a constant Lane reads it, all
four where the lane loop's `lane` picks it (the loop runs over them) or where vector arithmetic, a swizzle or a
window call takes it, one lane where another run-time index picks it; a Load bound to a variable, the union of
its readers' lanes. Two counts: static (fetch sites) and executed, where the kernel's integer prologue is
evaluated for every work-item with numpy (g = 0 .. global size - 1): an If or a `?:` weighs each branch by the
work-items that take it (a row path's per-lane fallback runs only at row ends), a loop by its evaluated trips
(loops of constant bounds up to 16 trips are walked iteration by iteration, so the lane loop's conditions are
exact; a bound it cannot evaluate counts its `min(k, ..)` constant, else once). fblc/tools/kernel_stats.py
(issue 39's benchmark figures) counts the same metric with upper-bound weights and a window's shifted lanes;
this one is for finding which kernel and operand the one-lane fetches come from.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any, Callable, Iterator

import numpy as np

from fblc.codegen.cl import Kernel
from fblc.codegen.ir import expressions as ex
from fblc.codegen.ir import statements as st
from fblc.codegen.plan import kernel_groups, lower, step_schedules
from fblc.compiler.index_map import view_root
from fblc.compiler.model_io import load_model
from fblc.compiler.values import static_shape
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.profiles import load_profile

WALKED_TRIPS = 16  # constant loops up to this many trips are evaluated iteration by iteration
GLOBAL_ID = "__global_id"
_NUMPY_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": np.add, "-": np.subtract, "*": np.multiply, "&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor,
    "<<": np.left_shift, ">>": np.right_shift, "<": np.less, "<=": np.less_equal, ">": np.greater,
    ">=": np.greater_equal, "==": np.equal, "!=": np.not_equal, "&&": np.logical_and, "||": np.logical_or}


class Unknown(Exception):
    """An expression the evaluator cannot compute per work-item (a float, a loop variable, a texel)."""


def evaluate(e: ex.Expr, env: dict[Any, Any]) -> Any:
    """The integer value of `e` for every work-item (numpy), or Unknown."""
    if isinstance(e, ex.Const):
        if isinstance(e.value, float):
            raise Unknown
        return np.uint64(int(e.value)) if e.dtype.scalar == "ulong" else np.int64(int(e.value))
    if isinstance(e, ex.Var):
        if e in env:
            return env[e]
        raise Unknown
    if isinstance(e, ex.Binary):
        a, b = evaluate(e.a, env), evaluate(e.b, env)
        if "ulong" in (e.dtype.scalar, e.a.dtype.scalar):
            a, b = np.asarray(a).astype(np.uint64), np.asarray(b).astype(np.uint64)
        if e.op in ("/", "%"):
            raise Unknown
        result = _NUMPY_OPS[e.op](a, b)
        return result.astype(np.int64) if np.asarray(result).dtype == bool else result
    if isinstance(e, ex.Unary):
        a = evaluate(e.a, env)
        return -a if e.op == "-" else (np.asarray(a) == 0).astype(np.int64)
    if isinstance(e, ex.Cast) and e.dtype.scalar in ("ulong", "int", "uint"):
        return np.asarray(evaluate(e.a, env)).astype(np.uint64 if e.dtype.scalar == "ulong" else np.int64)
    if isinstance(e, ex.Select):
        return np.where(evaluate(e.condition, env) != 0, evaluate(e.if_true, env), evaluate(e.if_false, env))
    if isinstance(e, ex.Call):
        if e.function in ("get_global_id", "get_group_id"):
            return env[GLOBAL_ID]
        functions = {"min": np.minimum, "max": np.maximum, "clamp": np.clip}
        if e.function in functions:
            return functions[e.function](*(evaluate(a, env) for a in e.args))
    raise Unknown


def _children(e: ex.Expr) -> Iterator[ex.Expr]:
    for value in vars(e).values():
        if isinstance(value, ex.Expr):
            yield value
        elif isinstance(value, tuple):
            yield from (item for item in value if isinstance(item, ex.Expr))


def _upper_bound(e: ex.Expr) -> int | None:
    if isinstance(e, ex.Const):
        return int(e.value)
    if isinstance(e, ex.Call) and e.function == "min":
        bounds = [b for b in map(_upper_bound, e.args) if b is not None]
        return min(bounds) if bounds else None
    return None


class LaneCount:
    """The fetches of one kernel: (lanes used, executions, argument name) per Load site."""

    def __init__(self, kernel: Kernel) -> None:
        self.sites: dict[int, list[Any]] = {}  # id of the Load (or its Declare) -> [argument, executions, lanes]
        self.bound: dict[Any, list[Any]] = {}  # variable -> its Load's site
        ids = np.arange(kernel.global_size, dtype=np.int64)
        self.env: dict[Any, Any] = {GLOBAL_ID: ids, **{ex.Var(n, 0, ex.INT, n): ids for n in ("g", "t")}}
        self.statements(kernel.ir.body, np.ones(kernel.global_size))

    def fetches(self) -> list[tuple[int, float, str]]:
        return [(len(lanes) or 4, runs, argument.name) for argument, runs, lanes in self.sites.values()
                if argument.kind != "uint"]  # a mask's byte has no lanes to waste

    def value(self, e: ex.Expr) -> Any:
        try:
            return evaluate(e, self.env)
        except (Unknown, KeyError, TypeError, ValueError):
            return None

    def use(self, e: ex.Expr, weight: np.ndarray, lanes: set[int] | None) -> None:
        """Visit `e`, executed `weight` times per work-item; `lanes`: the lanes of it its reader uses (None: all)."""
        if isinstance(e, ex.Select):
            self.use(e.condition, weight, None)
            taken = self.value(e.condition)
            if taken is None:  # both sides counted whole
                self.use(e.if_true, weight, lanes)
                self.use(e.if_false, weight, lanes)
            else:
                taken = np.asarray(taken) != 0
                self.use(e.if_true, weight * taken, lanes)
                self.use(e.if_false, weight * ~taken, lanes)
            return
        if isinstance(e, ex.Load):
            self._record(id(e), e, weight, lanes)
            return
        if isinstance(e, ex.Var) and e in self.bound:
            self.bound[e][2].update(range(4) if lanes is None else lanes)
            return
        if isinstance(e, ex.Lane):
            index = e.index
            picked = ({int(index.value)} if isinstance(index, ex.Const) else
                      set(range(4)) if isinstance(index, ex.Var) and index.name == "lane" else {0})
            self.use(e.vector, weight, picked)
            self.use(index, weight, None)
            return
        if isinstance(e, ex.Swizzle):
            self.use(e.vector, weight, set(range(e.first, e.first + e.count)))
            return
        for child in _children(e):
            self.use(child, weight, None)

    def _record(self, key: int, load: ex.Load, weight: np.ndarray, lanes: set[int] | None) -> list[Any]:
        site = self.sites.setdefault(key, [load.argument, 0.0, set()])
        site[1] += float(np.sum(weight))
        site[2].update(range(4) if lanes is None else lanes)
        self.use(load.texel, weight, None)
        return site

    def statements(self, body: list[st.Statement], weight: np.ndarray) -> None:
        for s in body:
            if isinstance(s, st.Declare) and isinstance(s.init, ex.Load):
                self.bound[s.var] = self._record(id(s), s.init, weight, set())
                continue
            if isinstance(s, st.Declare) and s.init is not None and s.const:
                known = self.value(s.init)
                if known is not None:
                    self.env[s.var] = known
            if isinstance(s, st.For):
                self._loop(s, weight)
            elif isinstance(s, st.If):
                self.use(s.condition, weight, None)
                taken = self.value(s.condition)
                if taken is None:  # both branches counted whole
                    self.statements(s.then, weight)
                    self.statements(s.orelse, weight)
                else:
                    taken = np.asarray(taken) != 0
                    self.statements(s.then, weight * taken)
                    self.statements(s.orelse, weight * ~taken)
            elif isinstance(s, st.While):
                self.statements(s.body, weight)
            else:
                for e in st.statement_exprs(s):
                    self.use(e, weight, None)

    def _loop(self, s: st.For, weight: np.ndarray) -> None:
        for e in (s.start, s.stop, s.condition):
            if e is not None:
                self.use(e, weight, None)
        plain = s.condition is None and s.step_op == "+=" and s.stop is not None
        if plain and isinstance(s.start, ex.Const) and isinstance(s.stop, ex.Const) \
                and (s.stop.value - s.start.value) / s.step <= WALKED_TRIPS:
            for iteration in range(int(s.start.value), int(s.stop.value), s.step):
                self.env[s.var] = np.int64(iteration)
                self.statements(s.body, weight)
            self.env.pop(s.var, None)
            return
        start, stop = self.value(s.start), self.value(s.stop) if s.stop is not None else None
        if plain and start is not None and stop is not None:
            trips = np.maximum(0, -(-(stop - start) // s.step))
        else:
            high, low = (_upper_bound(s.stop) if s.stop is not None else None), _upper_bound(s.start) or 0
            trips = max(1, -(-(high - low) // s.step)) if high is not None and plain else 1
        self.statements(s.body, weight * trips)


def _category(anchor: Any, family: str) -> str:
    """A kernel's kind: a conv's depthwise / 1x1 / kxk (and a weight gradient's), else family:op type."""
    if anchor.op_type not in ("Conv", "ConvTranspose"):
        return f"{family}:{anchor.op_type}"
    group = anchor.attributes["group"].value if "group" in anchor.attributes else 1
    kind = "depthwise" if group > 1 else "1x1" if all(k == 1 for k in static_shape(anchor.inputs[1])[2:]) else "kxk"
    weights = anchor.inputs[1].producer()  # a weight gradient's 'weights' are dY, an input gradient's a packing
    weight_gradient = anchor.op_type == "Conv" and weights is not None and weights.op_type != "Transpose" \
        and "grad" in (anchor.inputs[1].name or "")
    return f"{anchor.op_type}:{kind}{':wgrad' if weight_gradient else ''}"


def _shares(counts: collections.Counter[int]) -> str:
    total = sum(counts.values()) or 1
    return "  ".join(f"{lanes}:{100 * counts[lanes] / total:5.1f}%" for lanes in (1, 2, 3, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--target", default="adreno830")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--detail", default="", help="kernel names whose every fetch site to list")
    args = parser.parse_args()
    profile = load_profile(args.target)
    step = build_training_graph(load_model(args.model), TrainingOptions(dtype=args.dtype), lower=profile,
                                schedules=step_schedules(profile, args.dtype, None))
    program = lower(step, profile, args.dtype, with_contents=False)
    anchors = {group.name: group.anchor for group in kernel_groups(step.graph)}
    static: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    runs: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    by_operand: collections.Counter[tuple[str, str]] = collections.Counter()
    kernels = []
    for kernel in program.kernels:
        anchor = anchors[kernel.name]
        category = _category(anchor, kernel.family)
        roots = [view_root(v).name for v in anchor.inputs[:2] if v is not None]
        own: collections.Counter[int] = collections.Counter()
        for lanes, executions, argument in LaneCount(kernel).fetches():
            static[kernel.family][lanes] += 1
            static["ALL"][lanes] += 1
            for key in (kernel.family, "ALL", f"  {category}"):
                runs[key][lanes] += executions
            own[lanes] += executions
            names = set(program.textures[kernel.inputs[int(argument[2:])]].values)
            role = next((r for r, root in zip(("x", "w"), roots) if root in names), "epilogue")
            if lanes == 1:
                by_operand[(category, role)] += executions
            if kernel.name in args.detail.split(","):
                print(f"{kernel.name} {argument:<5} {role:<9} lanes {lanes}  executions {executions:12.0f}")
        kernels.append((own[1], kernel.name, kernel.family, kernel.global_size, own))
    total = sum(runs["ALL"].values()) or 1
    print(f"== {args.model} {args.target} {args.dtype}: {len(program.kernels)} launches")
    print("static fetch sites, by lanes used:")
    for family in sorted(static):
        print(f"  {family:<26} {sum(static[family].values()):>10}  {_shares(static[family])}")
    print("executed fetches, by lanes used (family, then kernel category):")
    for key in sorted(runs, key=lambda k: (k.startswith(" "), -runs[k][1])):
        print(f"  {key:<26} {sum(runs[key].values()):>12.0f}  {_shares(runs[key])}  "
              f"(one-lane: {100 * runs[key][1] / total:4.1f}% of all)")
    print("one-lane executed fetches by category and operand (x: data input, w: weights, epilogue: the rest):")
    for (category, role), executions in by_operand.most_common(args.top):
        print(f"  {category:<26} {role:<9} {100 * executions / total:5.1f}% of all fetches")
    print("kernels with the most one-lane executed fetches:")
    for ones, name, family, items, own in sorted(kernels, reverse=True)[: args.top]:
        print(f"  {name:<28} {family:<12} items {items:>7}  one-lane {100 * ones / total:4.1f}% of all; "
              f"its own: {_shares(own)}")
    print(f"whole-texel fetches: static {100 * static['ALL'][4] / max(1, sum(static['ALL'].values())):.1f}%  "
          f"executed {100 * runs['ALL'][4] / total:.1f}%")


if __name__ == "__main__":
    main()
