"""Kernel IR statements, the kernel, and `Block`, which builds statements and hands back their variables."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, Union


from fblc.codegen.ir.expressions import (INT, Argument, Binary, Call, Cast, DType, Element, Expr, Lane, Load, Operand,
                                         Select, Swizzle, Unary, Var, Vector, const)


# statements ---------------------------------------------------------------------------------------
@dataclass(eq=True)
class Declare:
    var: Var
    init: Expr | None = None
    const: bool = True


@dataclass(eq=True)
class DeclareArray:
    """An array of `length` elements of var.dtype: private (in registers) or __local (shared by a work-group)."""

    var: Var
    length: int | Expr
    init: tuple[Expr, ...] = ()
    local: bool = False
    constant: bool = False  # read-only after its initializer (a table the compiler may put in constant memory)


@dataclass(eq=True)
class Assign:
    target: Var | Element | Lane  # a Lane: a constant lane of a vector variable (acc.x)
    value: Expr
    op: str = "="  # "=", "+=", "|=", ... ; "=" on a Var declared non-const


@dataclass(eq=True)
class Store:
    """Write texel `texel` of output `argument` (a mask's byte: the value's lane x)."""

    argument: Argument
    texel: Expr
    value: Expr


@dataclass(eq=True)
class Evaluate:
    expr: Expr


@dataclass(eq=True)
class For:
    """for (var = start; var < stop; var += step): `condition` and `step_op` give other forms
    (a tree's `s > 0; s >>= 1`)."""

    var: Var
    start: Expr
    stop: Expr | None
    body: list[Statement]
    step: int = 1
    unroll: bool = False
    condition: Expr | None = None  # replaces var < stop
    step_op: str = "+="


@dataclass(eq=True)
class If:
    condition: Expr
    then: list[Statement]
    orelse: list[Statement] = field(default_factory=list)


@dataclass(eq=True)
class Break:
    pass


@dataclass(eq=True)
class Return:
    pass


@dataclass(eq=True)
class Barrier:
    """barrier(CLK_LOCAL_MEM_FENCE): every work-item of the group has written its __local values."""


@dataclass(eq=True)
class While:
    """while (condition) { body }: a loop whose trip count the data decides (a binary search)."""

    condition: Expr
    body: list[Statement]


Statement = Union[Declare, DeclareArray, Assign, Store, Evaluate, For, If, Break, Return, Barrier, While]


@dataclass
class KernelIR:
    """One __kernel: its name, texture arguments (outputs first) and body."""

    name: str
    arguments: list[Argument]
    body: list[Statement]


class Numbering:
    """Variable numbers of one kernel: one counter for every kind, shared with `fresh` names, so a
    number is unique in the kernel. Numbers start at FIRST_NUMBER, above any axis or output index,
    so `o123` never meets the fixed name of axis 1 of the output index (`o1`)."""

    FIRST_NUMBER = 100

    def __init__(self) -> None:
        self.count = self.FIRST_NUMBER - 1

    def next(self) -> int:
        self.count += 1
        return self.count


class Block:
    """A list of statements being built, with handles for what it declares; `with` blocks nest."""

    def __init__(self, numbering: Numbering, statements: list[Statement] | None = None) -> None:
        self.numbering = numbering
        self.statements: list[Statement] = statements if statements is not None else []

    def var(self, kind: str, dtype: DType, name: str = "") -> Var:
        return Var(kind, self.numbering.next(), dtype, name)

    def let(self, value: Expr, kind: str = "v", dtype: DType | None = None) -> Var:
        """A const value computed once: the renderer folds it into its reader when it has one."""
        var = self.var(kind, dtype or value.dtype)
        self.statements.append(Declare(var, value if dtype is None else value.cast(dtype)))
        return var

    def mutable(self, value: Expr | None, kind: str, dtype: DType | None = None, name: str = "") -> Var:
        """A variable assigned again later (an accumulator)."""
        assert value is not None or dtype is not None
        var = self.var(kind, dtype or value.dtype, name)  # type: ignore[union-attr]
        self.statements.append(Declare(var, value, const=False))
        return var

    def array(self, kind: str, dtype: DType, length: int | Expr, init: Sequence[Operand] = (),
              local: bool = False, name: str = "", constant: bool = False) -> Var:
        var = self.var(kind, dtype, name)
        self.statements.append(DeclareArray(var, length, tuple(
            v if isinstance(v, Expr) else const(v, dtype) for v in init), local, constant))
        return var

    def assign(self, target: Var | Element | Lane, value: Operand, op: str = "=") -> None:
        self.statements.append(Assign(target, value if isinstance(value, Expr) else const(value, target.dtype), op))

    def store(self, argument: Argument, texel: Expr, value: Expr) -> None:
        self.statements.append(Store(argument, texel, value))

    def add(self, *statements: Statement) -> None:
        self.statements.extend(statements)

    @contextmanager
    def loop(self, kind: str, start: Operand, stop: Operand | None, step: int = 1, unroll: bool = False,
             condition: Callable[[Var], Expr] | None = None, step_op: str = "+=", name: str = ""
             ) -> Iterator[tuple[Var, Block]]:
        """for (kind = start; kind < stop; kind += step), or while `condition(kind)` holds, stepping by `step_op`."""
        var = self.var(kind, INT, name)
        body: list[Statement] = []
        start_expr = start if isinstance(start, Expr) else const(start)
        stop_expr = stop if isinstance(stop, Expr) or stop is None else const(stop)
        self.statements.append(For(var, start_expr, stop_expr, body, step, unroll,
                                   condition(var) if condition else None, step_op))
        yield var, Block(self.numbering, body)

    @contextmanager
    def when(self, condition: Expr) -> Iterator[Block]:
        body: list[Statement] = []
        self.statements.append(If(condition, body))
        yield Block(self.numbering, body)

    def either(self, condition: Expr) -> tuple[Block, Block]:
        """if (condition) {..} else {..}: the two blocks to build into."""
        then: list[Statement] = []
        orelse: list[Statement] = []
        self.statements.append(If(condition, then, orelse))
        return Block(self.numbering, then), Block(self.numbering, orelse)

    @contextmanager
    def repeat_while(self, condition: Expr) -> Iterator[Block]:
        body: list[Statement] = []
        self.statements.append(While(condition, body))
        yield Block(self.numbering, body)


def walk_expr(expr: Expr) -> Iterator[Expr]:
    """`expr` and every expression inside it, parents first."""
    yield expr
    for child in children(expr):
        yield from walk_expr(child)


def children(expr: Expr) -> tuple[Expr, ...]:
    if isinstance(expr, (Binary,)):
        return (expr.a, expr.b)
    if isinstance(expr, (Unary, Cast)):
        return (expr.a,)
    if isinstance(expr, Call):
        return expr.args
    if isinstance(expr, Select):
        return (expr.condition, expr.if_true, expr.if_false)
    if isinstance(expr, Vector):
        return expr.parts
    if isinstance(expr, Lane):
        return (expr.vector, expr.index)
    if isinstance(expr, Element):
        return (expr.array, expr.index)
    if isinstance(expr, Load):
        return (expr.texel,)
    if isinstance(expr, Swizzle):
        return (expr.vector,)
    return ()


def statement_exprs(statement: Statement) -> tuple[Expr, ...]:
    """The expressions a statement reads (its own, not those of nested statements)."""
    if isinstance(statement, Declare):
        return (statement.init,) if statement.init is not None else ()
    if isinstance(statement, DeclareArray):
        return statement.init + ((statement.length,) if isinstance(statement.length, Expr) else ())
    if isinstance(statement, Assign):
        return ((statement.target.index,) if isinstance(statement.target, Element) else ()) + (statement.value,)
    if isinstance(statement, Store):
        return (statement.texel, statement.value)
    if isinstance(statement, Evaluate):
        return (statement.expr,)
    if isinstance(statement, For):
        return tuple(e for e in (statement.start, statement.stop, statement.condition) if e is not None)
    if isinstance(statement, (If, While)):
        return (statement.condition,)
    return ()


def nested(statement: Statement) -> tuple[list[Statement], ...]:
    if isinstance(statement, (For, While)):
        return (statement.body,)
    if isinstance(statement, If):
        return (statement.then, statement.orelse)
    return ()


def walk(statements: Sequence[Statement]) -> Iterator[Statement]:
    """Every statement, nested ones included, in program order."""
    for statement in statements:
        yield statement
        for body in nested(statement):
            yield from walk(body)


