"""Texel-wide lanes: a texel's lane loop (KernelBuilder._texel) as one float4 computation, where every output
lane is the same float arithmetic of values that are either the lane's element of an array or a texel the
lanes share (`lane_f(T, lane)`, `acc[tt * 4 + lane]`) or the same for all four lanes.

Why: a contraction's epilogue (GELU's erf_rational, its derivative's exp) ran per lane as scalar code, and
a scalar `exp` or `erf_rational` cost PoCL about 5-7 ns an element there against under 1 ns on float4s
(BERT's FFN MatMul with GELU 1.59 -> 0.78 ms, its twin without GELU 0.64 ms). On a GPU the float4 form is the
same arithmetic, in a texel's registers (a half kernel's retyping, codegen/ir/precision.py, comes after and
meets float4s as it meets floats). Anything else (a lane's own index but in a comparison with an integer the
lanes share, a per-lane read, an integer value, a statement other than a declaration) leaves the loop per lane:
`vectorize` answers None.

Comparisons and IS_PREDICATES of float4s give int4s, whose true is -1 where a scalar's is 1: such a value may only
select (a lane-varying Select: OpenCL's vector ?: takes each lane by its condition's sign bit) or be a mask
output (stored as `lane != 0`); no arithmetic or cast meets it. A half kernel's select of a vector condition
computes its values in float (codegen/ir/precision.py), so an int4 condition never meets half4 values.
Elementwise kernels take the form too: Softmax's exp(x - lse) with its IsNaN mask and Where was a scalar exp
per element at about 8 ns (GPT-2's 0.26 ms per launch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from fblc.bundle_format import MASK_FORMATS
from fblc.codegen.ir import FLOAT, FLOAT4, INT, INT4, Expr, Var
from fblc.codegen.ir import expressions as e
from fblc.codegen.ir import statements as s

if TYPE_CHECKING:
    from fblc.codegen.builder import KernelBuilder

#: families whose lane loop takes float4 arithmetic where it can: the contractions' epilogues, elementwise maps
FAMILIES = ("matmul", "elementwise")

#: float functions that take a float4 lane by lane as they take a float (name in the float4 form)
FUNCTIONS = {name: name for name in ("exp", "log", "sqrt", "tanh", "sin", "cos", "atan", "fabs", "floor", "ceil",
                                     "rint", "fmax", "fmin", "clamp")}
FUNCTIONS["erf_rational"] = "erf_rational4"  # the preamble's float4 form
ARITHMETIC = ("+", "-", "*", "/")
COMPARISONS = ("<", ">", "<=", ">=", "==", "!=")
#: predicates of a float that give an int4 (true -1) for a float4
IS_PREDICATES = ("isnan", "isinf", "isfinite")
#: the lane variable as an int4: a comparison of it with an integer the lanes share (`lane < n`, where a texel
#: crosses the end of a row of N % 4 != 0 elements: attention over 65 tokens) is an int4 condition
LANE_INDICES = e.Vector(INT4, tuple(e.const(k) for k in range(4)))


class _Scalar(Exception):
    """The lane loop does not take the float4 form."""


class _Lanes:
    def __init__(self, lane: Var, block: s.Block) -> None:
        self.lane, self.block = lane, block
        # by the name the source gives a variable: emitters may each make their own Var of a fixed name (o3)
        self.vectors: dict[str, Var] = {}  # a lane variable -> its float4 form
        self.scalar: set[str] = set()  # lane variables with no float4 form

    def varies(self, expr: Expr) -> bool:
        """Whether `expr` differs between lanes."""
        return any(_is(x, self.lane) or _name(x) in self.vectors or _name(x) in self.scalar
                   for x in s.walk_expr(expr) if isinstance(x, Var))

    def lanes(self, expr: Expr) -> Expr:
        """`expr` of the 4 lanes as one vector expression (an unvarying scalar stays scalar)."""
        if not self.varies(expr):
            if expr.dtype not in (FLOAT, INT):
                raise _Scalar
            return expr
        if isinstance(expr, Var):
            if _name(expr) in self.vectors:
                return self.vectors[_name(expr)]
            raise _Scalar
        if isinstance(expr, e.Element) and expr.array.dtype == FLOAT and not self.varies(expr.array):
            index = expr.index
            if any(_name(x) in self.vectors or _name(x) in self.scalar for x in s.walk_expr(index) if isinstance(x, Var)):
                raise _Scalar
            return e.Vector(FLOAT4, tuple(e.Element(expr.array, _substitute(index, self.lane, k)) for k in range(4)))
        if isinstance(expr, e.Lane) and _is(expr.index, self.lane) and expr.vector.dtype == FLOAT4 \
                and not self.varies(expr.vector):
            return expr.vector
        if isinstance(expr, e.Binary) and expr.op in ARITHMETIC and expr.dtype == FLOAT:
            return e.Binary(expr.op, self.lanes(expr.a), self.lanes(expr.b), FLOAT4)
        if isinstance(expr, e.Unary) and expr.op == "-" and expr.dtype == FLOAT:
            return e.Unary("-", self.lanes(expr.a), FLOAT4)
        if isinstance(expr, e.Call) and expr.function in FUNCTIONS and expr.dtype == FLOAT \
                and all(a.dtype == FLOAT for a in expr.args):
            return e.Call(FUNCTIONS[expr.function], tuple(_wide(self.lanes(a)) for a in expr.args), FLOAT4)
        if isinstance(expr, e.Binary) and expr.op in COMPARISONS and expr.dtype == INT \
                and expr.a.dtype == FLOAT and expr.b.dtype == FLOAT:
            return e.Binary(expr.op, _wide(self.lanes(expr.a)), _wide(self.lanes(expr.b)), INT4)
        if isinstance(expr, e.Binary) and expr.op in COMPARISONS and expr.dtype == INT \
                and INT == expr.a.dtype == expr.b.dtype and self._lane_or_fixed(expr.a) and self._lane_or_fixed(expr.b):
            return e.Binary(expr.op, self._int_lanes(expr.a), self._int_lanes(expr.b), INT4)
        if isinstance(expr, e.Call) and expr.function in IS_PREDICATES and expr.dtype == INT \
                and len(expr.args) == 1 and expr.args[0].dtype == FLOAT:
            return e.Call(expr.function, (_wide(self.lanes(expr.args[0])),), INT4)
        if isinstance(expr, e.Select) and expr.dtype == FLOAT:
            condition = self.lanes(expr.condition) if self.varies(expr.condition) else expr.condition
            if condition.dtype not in (INT, INT4):
                raise _Scalar
            return e.Select(condition, _wide(self.lanes(expr.if_true)), _wide(self.lanes(expr.if_false)), FLOAT4)
        raise _Scalar

    def _lane_or_fixed(self, expr: Expr) -> bool:
        """Whether `expr` is the lane variable itself or an integer the same for all four lanes."""
        return _is(expr, self.lane) or not self.varies(expr)

    def _int_lanes(self, expr: Expr) -> Expr:
        """An int4 of `expr` (_lane_or_fixed): the lanes' own indices 0..3, or the value in every lane."""
        return LANE_INDICES if _is(expr, self.lane) else e.Vector(INT4, (expr,))

    def declare(self, statement: s.Statement) -> None:
        """A statement of the lane loop: a declaration gets its float4 form where it varies by lane."""
        if not isinstance(statement, s.Declare) or statement.init is None or not statement.const:
            raise _Scalar
        var, init = statement.var, statement.init
        if not self.varies(init):
            self.block.add(statement)  # the same for every lane: declared once
            return
        try:
            value = self.lanes(init)
        except _Scalar:
            self.scalar.add(_name(var))  # an error only where a result needs it
            return
        self.vectors[_name(var)] = self.block.let(value, var.kind, value.dtype)


def _name(var: Var) -> str:
    """The variable's name in the source (render/opencl.py name_of)."""
    return var.name or f"{var.kind}{var.number}"


def _is(expr: Expr, lane: Var) -> bool:
    """Whether `expr` is the lane variable (the loop's and the reads' own declaration of it share its name)."""
    return isinstance(expr, Var) and _name(expr) == _name(lane)


def _wide(expr: Expr) -> Expr:
    """A float4 of `expr`: a scalar float as (float4)(x), where an operand must be a vector (a function's)."""
    return expr if expr.dtype.lanes == 4 else e.Vector(FLOAT4, (expr,))


def _substitute(expr: Expr, lane: Var, value: int) -> Expr:
    """`expr` with `lane` replaced by the literal `value`."""
    if _is(expr, lane):
        return e.const(value)
    if isinstance(expr, e.Binary):
        return e.Binary(expr.op, _substitute(expr.a, lane, value), _substitute(expr.b, lane, value), expr.dtype)
    if any(_is(x, lane) for x in s.walk_expr(expr)):
        raise _Scalar
    return expr


def vectorize(lane: Var, statements: Sequence[s.Statement], results: Sequence[Expr],
              block: s.Block) -> list[Expr] | None:
    """The float4 of each result over the 4 lanes of `lane`, its declarations added to `block` (the lane
    loop's `statements` in their float4 form); None (and `block` to be dropped) where the loop does not take it."""
    lanes = _Lanes(lane, block)
    try:
        for statement in statements:
            lanes.declare(statement)
        vectors = [_wide(lanes.lanes(result)) for result in results]
    except _Scalar:
        return None
    return vectors


def texel_form(b: KernelBuilder, results: Sequence[Expr], in_one_row: bool) -> tuple[list[s.Statement], list[Expr]] | None:
    """The lane loop of builder `b`'s texel as float4 arithmetic: its statements and each result's float4 (an
    int4 for a mask: its lanes' truth), for a family of FAMILIES whose outputs are float textures or masks the
    tensor fills whole; else None (the loop per lane)."""
    masks = [t.format in MASK_FORMATS.values() for t in b.out_textures]
    if b.family not in FAMILIES or b.out_textures[0].numel % 4 or any(
            t.kind != "float" and not mask for t, mask in zip(b.out_textures, masks)):
        return None
    lane = Var("lane", 0, INT, "lane")
    header, wide = s.Block(b.numbering), s.Block(b.numbering)
    b.lane_header(header, lane, in_one_row)
    vectors = vectorize(lane, [*header.statements, *b.lines], results, wide)
    if vectors is None or any(v.dtype != (INT4 if mask else FLOAT4) for v, mask in zip(vectors, masks)):
        return None
    return wide.statements, vectors
