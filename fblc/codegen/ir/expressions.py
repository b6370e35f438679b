"""Kernel IR expressions: types, values, arithmetic, texel loads, and index arithmetic by constants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union, dataclass_transform

from fblc.texel_layout import reciprocal

__all__ = ["DType", "INT", "UINT", "ULONG", "UCHAR", "FLOAT", "HALF", "FLOAT4", "INT4", "UINT4", "HALF4", "FLOAT8",
           "REAL", "REAL4",
           "ELEMENT_TYPES", "TEXEL_TYPES", "Operand", "Expr", "Const", "const", "as_expr", "Var", "Binary", "Unary",
           "Call", "call", "Select", "select", "Cast", "Vector", "vector", "Lane", "Element", "Argument", "Load",
           "StagedChoice", "Swizzle", "ArgumentRef", "div_index", "mod_index", "flat_index"]


@dataclass(frozen=True)
class DType:
    """A C scalar or vector type: `scalar` (int, uint, ulong, float, half, uchar, real) and `lanes` (1, 2, 4, 8).
    `real` is a half kernel's arithmetic type (codegen/ir/precision.py): the preamble makes it `half` where the
    device has cl_khr_fp16 and `float` elsewhere, so one source runs on both."""

    scalar: str
    lanes: int = 1
    #: a pointer into a work-group's local memory (a slice of a larger local array)
    local_pointer: bool = False

    @property
    def c_name(self) -> str:
        return self.scalar if self.lanes == 1 else f"{self.scalar}{self.lanes}"

    @property
    def is_float(self) -> bool:
        return self.scalar in ("float", "half", "real")

    def vector(self, lanes: int) -> DType:
        key = (self.scalar, lanes)  # one instance per type: a lane's dtype is asked for at every use (codegen time)
        found = _VECTOR_TYPES.get(key)
        if found is None:
            found = _VECTOR_TYPES[key] = DType(self.scalar, lanes)
        return found


_VECTOR_TYPES: dict[tuple[str, int], DType] = {}


INT, UINT, ULONG, UCHAR = DType("int"), DType("uint"), DType("ulong"), DType("uchar")
FLOAT, HALF = DType("float"), DType("half")
FLOAT4, INT4, UINT4, HALF4, FLOAT8 = FLOAT.vector(4), INT.vector(4), UINT.vector(4), HALF.vector(4), FLOAT.vector(8)
REAL = DType("real")
REAL4 = REAL.vector(4)

#: dtype of an element of a texture kind ("float" / "int"), and of its texel
ELEMENT_TYPES = {"float": FLOAT, "int": INT}
#: ("real": a float texture that a half kernel reads and writes)
TEXEL_TYPES = {"float": FLOAT4, "int": INT4, "uint": UINT4, "real": REAL4}

Operand = Union["Expr", int, float]


def _operator(op: str, swap: bool = False, dtype: DType | None = None) -> Callable[[Expr, Operand], Binary]:
    """An Expr method building `self op other` (swapped: `other op self`), of `dtype` or the wider operand type."""
    def method(self: Expr, other: Operand) -> Binary:
        rhs = as_expr(other, self.dtype)
        lhs, rhs = (rhs, self) if swap else (self, rhs)
        return Binary(op, lhs, rhs, dtype or _wider(lhs.dtype, rhs.dtype))
    return method


@dataclass_transform(frozen_default=True)
class Expr:
    """An IR expression. Python operators build arithmetic (`a + b`, `a * 2`); comparisons and logic
    are methods (`a.lt(b)`), since `==` compares IR structure: every kind of expression is a dataclass,
    frozen unless its class says `frozen=False`, compared and hashed by its fields."""

    dtype: DType

    def __init_subclass__(cls, frozen: bool = True) -> None:
        dataclass(frozen=frozen, unsafe_hash=True)(cls)

    __add__, __radd__ = _operator("+"), _operator("+", swap=True)
    __sub__, __rsub__ = _operator("-"), _operator("-", swap=True)
    __mul__, __rmul__ = _operator("*"), _operator("*", swap=True)
    __truediv__, __rtruediv__ = _operator("/"), _operator("/", swap=True)
    __and__, __or__, __xor__, __lshift__, __rshift__ = (_operator(op) for op in ("&", "|", "^", "<<", ">>"))
    lt, le, gt, ge, eq, ne = (_operator(op, dtype=INT) for op in ("<", "<=", ">", ">=", "==", "!="))
    logical_and, logical_or = _operator("&&", dtype=INT), _operator("||", dtype=INT)

    def __neg__(self) -> Unary:
        return Unary("-", self, self.dtype)

    def __invert__(self) -> Unary:
        return Unary("!", self, INT)

    def __format__(self, spec: str) -> str:
        raise TypeError("an IR expression is not C text: build IR with it (the renderer writes the C)")

    def cast(self, dtype: DType) -> Expr:
        return self if dtype == self.dtype else Cast(dtype, self)

    def lane(self, index: int | Expr) -> Expr:
        """Lane `index` of a vector (a constant lane: a component; a computed one: a select chain)."""
        return Lane(self, as_expr(index))


def _wider(a: DType, b: DType) -> DType:
    if a.lanes != b.lanes:
        return a if a.lanes > b.lanes else b
    order = ("uchar", "int", "uint", "ulong", "half", "real", "float")
    return a if order.index(a.scalar) >= order.index(b.scalar) else b


class Const(Expr):
    value: float | int | bool
    dtype: DType


def const(value: float | int | bool, dtype: DType = INT) -> Const:
    """A constant of `dtype`; a Python float makes a float constant whatever `dtype` says."""
    return Const(value, FLOAT if isinstance(value, float) and not dtype.is_float else dtype)


def as_expr(value: Operand, dtype: DType = INT) -> Expr:
    """`value` itself if an expression, else a constant of `dtype` (as `const`)."""
    return value if isinstance(value, Expr) else const(value, dtype)


class Var(Expr, frozen=False):
    """A declared value: `kind` names what it holds (the renderer names it kind + number); a fixed
    `name` only for the names that kernels share with the host or the preamble."""

    kind: str
    number: int
    dtype: DType
    name: str = ""


class Binary(Expr):
    op: str
    a: Expr
    b: Expr
    dtype: DType


class Unary(Expr):
    op: str
    a: Expr
    dtype: DType


class Call(Expr):
    """An OpenCL built-in or a preamble function: `function` (its name) applied to `args`."""

    function: str
    args: tuple[Expr, ...]
    dtype: DType


def call(function: str, *args: Operand, dtype: DType | None = None) -> Call:
    exprs = tuple(as_expr(a) for a in args)
    return Call(function, exprs, dtype or (exprs[0].dtype if exprs else INT))


class Select(Expr):
    condition: Expr
    if_true: Expr
    if_false: Expr
    dtype: DType


def select(condition: Expr, if_true: Operand, if_false: Operand) -> Select:
    true = as_expr(if_true, if_false.dtype if isinstance(if_false, Expr) else INT)
    false = as_expr(if_false, true.dtype)
    return Select(condition, true, false, _wider(true.dtype, false.dtype))


class Cast(Expr):
    dtype: DType
    a: Expr


class Vector(Expr):
    """A vector built from scalars or smaller vectors, (float4)(a, b, c, d)."""

    dtype: DType
    parts: tuple[Expr, ...]


def vector(dtype: DType, *parts: Operand) -> Vector:
    return Vector(dtype, tuple(as_expr(p, dtype.vector(1)) for p in parts))


class Lane(Expr):
    vector: Expr
    index: Expr
    dtype = property(lambda self: self.vector.dtype.vector(1))  # type: ignore[assignment]


class Element(Expr):
    """Element `index` of an array variable (private or __local)."""

    array: Var
    index: Expr
    dtype = property(lambda self: self.array.dtype)  # type: ignore[assignment]


@dataclass(frozen=True)
class Argument:
    """A kernel's texture argument: output or input `index`, of a texture whose texels
    have `kind` ("float" / "int" / "uint"; "real": a float texture a half kernel reads and writes in its
    arithmetic type) and whose place of texel t is `layout` (TexelLayout)."""

    role: str  # "out" or "in"
    index: int
    kind: str
    element: str  # C type of a buffer element (bundle_format.BUFFER_C_TYPES)
    layout: object

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def stored_as(self) -> str:
        """Its buffer element type, and "real:" before it where a half kernel converts its texels (the key of
        buffer storage's templates)."""
        return f"real:{self.element}" if self.kind == "real" else self.element


class Load(Expr):
    """Texel `texel` of texture argument `argument`, a whole 4-lane vector (a mask's byte: lane x); `staged`:
    the same texel in a work-group's __local copy (an Element), read instead where the storage stages (Stage)."""

    argument: Argument
    texel: Expr
    staged: Expr | None = None
    dtype = property(lambda self: TEXEL_TYPES[self.argument.kind])  # type: ignore[assignment]


class StagedChoice(Expr):
    """`staged` where the storage stages its reads (render.opencl.Storage.stages), else `plain` (codegen/kernels/
    staging.py): a staged kernel's item in its work-group's own order against the launch's, which a storage
    without staging keeps (neighbouring work-items read neighbouring memory); a masked element as one let or per
    product; an accumulator's update through its private copy (carried.py), as a value or an assignment's target."""

    plain: Expr
    staged: Expr
    dtype: DType


class Swizzle(Expr):
    """Lanes first .. first + count - 1 of a vector: a float8's half (.lo / .hi: 4 lanes from 0 or 4), a run
    of a float4's components (.yz)."""

    vector: Expr
    first: int
    count: int
    dtype = property(lambda self: self.vector.dtype.vector(self.count))  # type: ignore[assignment]


class ArgumentRef(Expr):
    """A texture argument handed to a preamble function (WINDOW reads texels of it)."""

    argument: Argument
    dtype = property(lambda self: TEXEL_TYPES[self.argument.kind])  # type: ignore[assignment]


# index arithmetic -----------------------------------------------------------------------------------
def div_index(index: Expr, divisor: int) -> Expr:
    """`index / divisor` for a non-negative int index below 2^31, without a division: a shift for a
    power of two, else a 64-bit multiply by the divisor's reciprocal and a shift (texel_layout.reciprocal).
    GPUs have no integer divider, and a driver's compiler need not strength-reduce a division itself."""
    if divisor == 1:
        return index
    if divisor & (divisor - 1) == 0:
        return index >> (divisor.bit_length() - 1)
    multiplier, shift = reciprocal(divisor)
    return Cast(INT, Binary(">>", Binary("*", Cast(ULONG, index), Const(multiplier, UINT), ULONG),
                            Const(32 + shift, INT), ULONG))


def mod_index(index: Expr, modulus: int) -> Expr:
    """`index % modulus` for a non-negative int index: a mask for a power of two, else the index less
    `modulus` times its quotient."""
    if modulus == 1:
        return const(0)
    if modulus & (modulus - 1) == 0:
        return index & (modulus - 1)
    return index - div_index(index, modulus) * modulus


def flat_index(terms: Sequence[tuple[Expr, int]], offset: int = 0) -> Expr:
    """sum(index * stride) + offset, dropping zero strides."""
    parts: list[Expr] = [index if stride == 1 else index * stride for index, stride in terms if stride != 0]
    parts += [const(offset)] if offset else []
    return sum(parts[1:], parts[0]) if parts else const(0)
