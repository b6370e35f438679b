"""Half arithmetic: a kernel's IR retyped to compute in `real`, which the source's preamble makes `half` on a
device with cl_khr_fp16 and `float` elsewhere (render/preamble.py REAL_PREAMBLE), so one bundle runs on both.

Emitters build float IR; `half_arithmetic` retypes a finished kernel (codegen/plan.py calls it under
`--dtype fp16` for a target whose profile has `fp16`). The rule:
- A kernel computes in half where every float texture it writes is half, or where every float texture it
  reads is half (a weight gradient: its operands are half already, its sums stay float, below). The master
  copy of training (parameters, their gradients, optimizer state), the loss chain and the step's outputs are
  fp32 textures (passes/storage_precision.py), so the kernels that read and write them (the optimizer update,
  the loss) stay all-float.
- It reads as half (read_imageh) its half textures and the parameters, whose half copy is what it multiplies
  by; any other fp32 texture it reads (the loss chain's gradient of the logits, a loss scale) stays float,
  and so do the parameters of a kernel that reads one (their products would be widened to meet it anyway).
- A value computed once (an elementwise chain, a reduction's products, a normalization) takes the type of
  its operands: real where they are all real, float where any is float (the real ones widened).
- Every accumulator, a variable assigned after it is declared (sums, running max / min, register tiles,
  `__local` partials), stays float whatever its length: a half sum of K terms drifts by about K half-ulps
  (2^-11 each), 3 % already at K = 64. Its products arrive in half; a run of up to HALF_RUN (4: one texel's
  lanes) added to one accumulator in a row is summed in half first and widened once.
- A literal takes its partner's type; a cast keeps its target (an index converted to float stays float:
  half holds integers exactly only up to 2048); built-ins outside HALF_FUNCTIONS, comparisons of
  vectors (a half4 comparison yields short4) and the values a vector condition selects between get their
  operands back in float.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from fblc.codegen.ir.expressions import (
    TEXEL_TYPES, Argument, ArgumentRef, Binary, Call, Cast, Const, DType, Element, Expr, Lane, Load, Select,
    StagedChoice, Swizzle, Unary, Var, Vector)
from fblc.codegen.ir.statements import (
    Assign, Declare, DeclareArray, For, If, KernelIR, Statement, Store, While, nested, statement_exprs, walk_expr)

__all__ = ["half_arithmetic", "computes_in_half", "arithmetic_counts", "HALF_FUNCTIONS"]

#: OpenCL built-ins that cl_khr_fp16 defines for half operands
HALF_FUNCTIONS = frozenset({
    "sqrt", "rsqrt", "exp", "expm1", "log", "log1p", "tanh", "erf", "sin", "cos", "atan", "fabs", "floor",
    "ceil", "rint", "fmax", "fmin", "max", "min", "clamp", "fma", "mad", "pow", "pown", "sign", "dot"})
#: the preamble's functions with a real twin
REAL_TWINS = {"window4": "window4_r"}
ARITHMETIC = frozenset("+-*/")
#: the most products a run of accumulations sums in real before adding them to its float accumulator: a half
#: sum of 4 terms is off by at most 3 half-ulps of their magnitudes (OpenCL's half rounds each to nearest)
HALF_RUN = 4
#: the storage of a half texture (bundle_format.BUFFER_C_TYPES of rgba_f16)
HALF_ELEMENT = "half"


def _floating(e: Expr) -> bool:
    return e.dtype.is_float and not e.dtype.local_pointer


def _as(e: Expr, scalar: str) -> Expr:
    """`e` in scalar type `scalar` (its lanes kept): a literal retyped, anything else cast."""
    if not _floating(e) or e.dtype.scalar == scalar:
        return e
    dtype = DType(scalar, e.dtype.lanes)
    return Const(e.value, dtype) if isinstance(e, Const) else Cast(dtype, e)


def _common(operands: Sequence[Expr]) -> str | None:
    """The scalar type float operands meet in: float where any computed one is float, else real; None where
    all are literals (they keep their type)."""
    computed = [e.dtype.scalar for e in operands if _floating(e) and not isinstance(e, Const)]
    if not computed:
        return None
    return "real" if all(s == "real" for s in computed) else "float"


def _retyped(dtype: DType, scalar: str | None) -> DType:
    return DType(scalar, dtype.lanes) if scalar and dtype.is_float and not dtype.local_pointer else dtype


class _Retype:
    """One kernel's retyping: arguments read or written as real, and the variables given a new type."""

    def __init__(self, arguments: dict[Argument, Argument]) -> None:
        self.arguments = arguments
        self.vars: dict[Var, Var] = {}

    # expressions ----------------------------------------------------------------------------------
    def expr(self, e: Expr) -> Expr:
        return getattr(self, "_" + type(e).__name__)(e)

    def _Const(self, e: Const) -> Expr:
        return e

    def _Var(self, e: Var) -> Expr:
        return self.vars.get(e, e)

    def _Load(self, e: Load) -> Expr:
        return Load(self.arguments.get(e.argument, e.argument), self.expr(e.texel))

    def _StagedChoice(self, e: StagedChoice) -> Expr:
        return StagedChoice(self.expr(e.plain), self.expr(e.staged), e.dtype)

    def _ArgumentRef(self, e: ArgumentRef) -> Expr:
        return ArgumentRef(self.arguments.get(e.argument, e.argument))

    def _meet(self, operands: Sequence[Expr], vector_in_float: bool = False) -> tuple[list[Expr], str | None]:
        scalar = _common(operands)
        if scalar == "real" and vector_in_float and any(e.dtype.lanes > 1 for e in operands):
            scalar = "float"
        return [_as(e, scalar) if scalar else e for e in operands], scalar

    def _Binary(self, e: Binary) -> Expr:
        comparison = not e.dtype.is_float
        (a, b), scalar = self._meet([self.expr(e.a), self.expr(e.b)], vector_in_float=comparison)
        return Binary(e.op, a, b, e.dtype if comparison else _retyped(e.dtype, scalar))

    def _Unary(self, e: Unary) -> Expr:
        a = self.expr(e.a)
        return Unary(e.op, a, a.dtype if e.dtype.is_float and _floating(a) else e.dtype)

    def _Call(self, e: Call) -> Expr:
        args = [self.expr(a) for a in e.args]
        if e.function == "WINDOW":  # a texel window of its argument: of the argument's texel type
            return Call(e.function, tuple(args), args[0].dtype)
        if e.function in HALF_FUNCTIONS or e.function in REAL_TWINS:
            args, scalar = self._meet(args)
            function = REAL_TWINS.get(e.function, e.function) if scalar == "real" else e.function
            return Call(function, tuple(args), _retyped(e.dtype, scalar))
        return Call(e.function, tuple(_as(new, old.dtype.scalar) for new, old in zip(args, e.args)), e.dtype)

    def _Select(self, e: Select) -> Expr:
        # a vector condition is an int4 (a float4 comparison's): its values float4, as ?: wants their lanes as wide
        (if_true, if_false), scalar = self._meet([self.expr(e.if_true), self.expr(e.if_false)],
                                                 vector_in_float=e.condition.dtype.lanes > 1)
        return Select(self.expr(e.condition), if_true, if_false, _retyped(e.dtype, scalar))

    def _Cast(self, e: Cast) -> Expr:
        return Cast(e.dtype, self.expr(e.a))

    def _Vector(self, e: Vector) -> Expr:
        parts, scalar = self._meet([self.expr(p) for p in e.parts])
        return Vector(_retyped(e.dtype, scalar), tuple(parts))

    def _Lane(self, e: Lane) -> Expr:
        return Lane(self.expr(e.vector), self.expr(e.index))

    def _Element(self, e: Element) -> Expr:
        return Element(e.array, self.expr(e.index))

    def _Swizzle(self, e: Swizzle) -> Expr:
        return Swizzle(self.expr(e.vector), e.first, e.count)

    # statements -----------------------------------------------------------------------------------
    def statements(self, body: Sequence[Statement]) -> list[Statement]:
        """The retyped statements; a run of accumulations `acc += (float)p` into one target (a texel's products)
        becomes `acc += (float)(p0 + p1 + ..)`, up to HALF_RUN terms summed in real."""
        merged: list[Statement] = []
        terms = 0  # the real terms merged[-1] adds to its accumulator (0: it is no such accumulation)
        for s in map(self.statement, body):
            term = _half_term(s)
            last = merged[-1] if merged else None
            if term is not None and 0 < terms < HALF_RUN and isinstance(last, Assign) and last.target == s.target:
                total = last.value.a  # type: ignore[attr-defined]
                merged[-1] = Assign(s.target, Cast(last.value.dtype, Binary("+", total, term, total.dtype)), "+=")
                terms += 1
                continue
            merged.append(s)
            terms = 1 if term is not None else 0
        return merged

    def statement(self, s: Statement) -> Statement:
        if isinstance(s, Declare):
            if s.init is None:
                return s
            init = self.expr(s.init)
            if s.const and _floating(init) and not isinstance(init, Const) and init.dtype.scalar != s.var.dtype.scalar:
                self.vars[s.var] = var = replace(s.var, dtype=_retyped(s.var.dtype, init.dtype.scalar))
                return replace(s, var=var, init=init)
            return replace(s, init=_as(init, s.var.dtype.scalar))  # an accumulator stays float
        if isinstance(s, DeclareArray):
            return replace(s, init=tuple(_as(self.expr(v), s.var.dtype.scalar) for v in s.init))
        if isinstance(s, Assign):
            target = self.expr(s.target)
            return Assign(target, _as(self.expr(s.value), target.dtype.scalar), s.op)  # type: ignore[arg-type]
        if isinstance(s, Store):
            argument = self.arguments.get(s.argument, s.argument)
            value = _as(self.expr(s.value), TEXEL_TYPES[argument.kind].scalar)
            return Store(argument, self.expr(s.texel), value)
        if isinstance(s, For):
            return replace(s, start=self.expr(s.start), stop=None if s.stop is None else self.expr(s.stop),
                           condition=None if s.condition is None else self.expr(s.condition),
                           body=self.statements(s.body))
        if isinstance(s, If):
            return If(self.expr(s.condition), self.statements(s.then), self.statements(s.orelse))
        if isinstance(s, While):
            return While(self.expr(s.condition), self.statements(s.body))
        return s  # Break, Return, Barrier


def _half_term(s: Statement) -> Expr | None:
    """The real value an accumulation `target += (float)value` adds, or None."""
    if isinstance(s, Assign) and s.op == "+=" and isinstance(s.value, Cast) and s.value.a.dtype.scalar == "real":
        accumulator = s.target.array if isinstance(s.target, Element) else s.target
        if all(e != accumulator for e in walk_expr(s.value.a)):  # a term reading its accumulator stays in order
            return s.value.a
    return None


def computes_in_half(kernel: KernelIR) -> bool:
    """Whether `half_arithmetic` retypes `kernel`: it writes float textures, all of them half, or it reads
    float textures, all of them half."""
    floats = [a for a in kernel.arguments if a.kind in ("float", "real")]
    return any(floats_of_role and all(a.element == HALF_ELEMENT for a in floats_of_role)
               for floats_of_role in ([a for a in floats if a.role == role] for role in ("out", "in")))


def half_arithmetic(kernel: KernelIR, parameters: Iterable[int] = ()) -> KernelIR:
    """`kernel` computing in `real` (the module docstring's rule), or `kernel` itself where it writes an fp32
    texture; `parameters`: the indices of its inputs that hold parameters (fp32 masters it reads as half)."""
    if not computes_in_half(kernel):
        return kernel
    inputs = [a for a in kernel.arguments if a.role == "in" and a.kind == "float"]
    masters = {a.index for a in inputs if a.element != HALF_ELEMENT} & set(parameters)
    if any(a.element != HALF_ELEMENT and a.index not in masters for a in inputs):
        masters = set()  # another fp32 input keeps the arithmetic float: a half copy of a parameter would only lose
    arguments = {a: replace(a, kind="real") for a in kernel.arguments if a.kind == "float" and (
        a.role == "out" or a.element == HALF_ELEMENT or a.index in masters)}
    retype = _Retype(arguments)
    body = retype.statements(kernel.body)
    return replace(kernel, arguments=[arguments.get(a, a) for a in kernel.arguments], body=body)  # group size kept


def arithmetic_counts(kernels: Iterable[KernelIR | tuple[KernelIR, int]]) -> dict[str, int]:
    """Float arithmetic of `kernels` (each +, -, *, / and HALF_FUNCTIONS call, and each compound assignment, once
    per lane of its type): {"real": in the arithmetic type, "float": in float}. A bare KernelIR counts its code
    once (static); a (KernelIR, work-items) pair counts what a launch executes: each operation times the trip
    counts of its loops whose bounds are literals (a loop of run-time length, rare, counts once) and the items."""
    counts = {"real": 0, "float": 0}
    for entry in kernels:
        kernel, items = entry if isinstance(entry, tuple) else (entry, 0)
        _count(kernel.body, max(items, 1), counts, weighted=items > 0)
    return counts


def _count(body: Sequence[Statement], weight: int, counts: dict[str, int], weighted: bool) -> None:
    for statement in body:
        if isinstance(statement, Assign) and statement.op != "=" and statement.target.dtype.is_float:
            counts["float"] += weight * statement.target.dtype.lanes  # accumulators are float
        for root in statement_exprs(statement):
            for e in walk_expr(root):
                arithmetic = (isinstance(e, Binary) and e.op in ARITHMETIC) or (
                    isinstance(e, Unary) and e.op == "-") or (isinstance(e, Call) and e.function in HALF_FUNCTIONS)
                if arithmetic and _floating(e):
                    counts["real" if e.dtype.scalar == "real" else "float"] += weight * e.dtype.lanes
        inner = weight * _trips(statement) if weighted and isinstance(statement, For) else weight
        for nested_body in nested(statement):
            _count(nested_body, inner, counts, weighted)


def _trips(loop: For) -> int:
    """A loop's trip count where its bounds are literals, else 1."""
    if isinstance(loop.start, Const) and isinstance(loop.stop, Const) and loop.condition is None and \
            loop.step_op == "+=":
        return max(0, -(-(int(loop.stop.value) - int(loop.start.value)) // loop.step))
    return 1
