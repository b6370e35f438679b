"""Kernel IR statements, the kernel, and `Block`, which builds statements and hands back their variables."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field, make_dataclass
from typing import Callable, ClassVar, Iterator, Sequence, Union

from fblc.codegen.ir.expressions import (INT, Argument, DType, Element, Expr, Lane, Operand, StagedChoice, Swizzle,
                                          Var, as_expr)

__all__ = ["Declare", "DeclareArray", "Assign", "Store", "For", "If", "Break", "Return", "Barrier", "While",
           "WithFeature", "Stage", "Invoke", "FEATURES", "Statement", "KernelIR", "Numbering", "Block", "walk_expr",
           "statement_exprs", "nested", "walk"]


@dataclass
class Declare:
    """`var` = `init`: const (read only), or assigned again later; `volatile`: read from memory wherever it is
    read (a value the device compiler must not fold or hoist: codegen/kernels/carried.py)."""

    var: Var
    init: Expr | None = None
    const: bool = True
    volatile: bool = False


@dataclass
class DeclareArray:
    """An array of `length` elements of var.dtype: private (in registers) or __local (shared by a work-group)."""

    var: Var
    length: int | Expr
    init: tuple[Expr, ...] = ()
    local: bool = False
    constant: bool = False  # read-only after its initializer (a table the compiler may put in constant memory)


@dataclass
class Assign:
    # a Lane or Swizzle: lanes of a vector variable (acc.x, acc.lo); a StagedChoice: the storage's choice of two
    target: Var | Element | Lane | Swizzle | StagedChoice
    value: Expr
    op: str = "="  # "=", "+=", "|=", ... ; "=" on a Var declared non-const


@dataclass
class Store:
    """Write texel `texel` of output `argument` (a mask's byte: the value's lane x)."""

    argument: Argument
    texel: Expr
    value: Expr


@dataclass
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


@dataclass
class If:
    condition: Expr
    then: list[Statement]
    orelse: list[Statement] = field(default_factory=list)


#: the statements without fields: `break;`, `return;` and barrier(CLK_LOCAL_MEM_FENCE), where every work-item
#: of the group has written its __local values
Break, Return, Barrier = (make_dataclass(name, (), namespace={"__module__": __name__})
                          for name in ("Break", "Return", "Barrier"))


@dataclass
class While:
    """while (condition) { body }: a loop whose trip count the data decides (a binary search)."""

    condition: Expr
    body: list[Statement]


@dataclass
class WithFeature:
    """`then` where the device compiler offers an optional OpenCL feature (FEATURES: "subgroups", the
    sub-group built-ins of cl_khr_subgroups), `orelse` where it does not: the choice is the device
    compiler's (a preprocessor test), so one source runs on devices with and without it."""

    feature: str
    then: list[Statement]
    orelse: list[Statement]


@dataclass
class Stage:
    """Work-group staging of texel reads (codegen/kernels/staging.py): `then` (the group's barriers and its
    copies of texels into __local arrays, or those arrays' declarations) where the storage stages its reads
    (render.opencl.Storage.stages: image2d textures, whose reads PoCL runs in software), nothing where it does
    not (buffers, whose loads are plain memory reads). A Load's `staged` read is its twin in the same storage."""

    then: list[Statement]


@dataclass
class Invoke:
    """A call of a function the source defines once (codegen/co_launch.py: the body of a kernel that a co-launched
    kernel runs too), with `arguments`: its texture arguments (ArgumentRef), the values it shifts its work-item
    ids by and its __local arrays (Var); `inputs_from`: the launch's input number of the function's input 0 (a
    trace records reads by the launch's input)."""

    function: str
    arguments: tuple[Expr, ...]
    inputs_from: int = 0


#: the optional features a WithFeature may test
FEATURES = ("subgroups",)

Statement = Union[Declare, DeclareArray, Assign, Store, For, If, Break, Return, Barrier, While, WithFeature, Stage,
                  Invoke]


@dataclass
class KernelIR:
    """One __kernel: its name, texture arguments (outputs first) and body; `group_size`: the one work-group
    size it is written for (its work-items share __local memory; the renderer states it as
    reqd_work_group_size, and the plan launches it so), or None: any."""

    name: str
    arguments: list[Argument]
    body: list[Statement]
    group_size: int | None = None
    #: the arguments one launch binds to one texture (an update in place, codegen/inplace.py): no `restrict`
    aliased: frozenset[str] = frozenset()
    #: a function's (co_launch.part_function), not a __kernel's: whether the device compiler's front end inlines it
    #: into each caller (always_inline): one with barriers, which the __kernel's compiler must see in its body
    inlined: bool = False


@dataclass(eq=False)
class Numbering:
    """Variable numbers of one kernel: one counter for every kind, so a number is unique in the kernel. Numbers
    start at FIRST_NUMBER, above any axis or output index: `o123` never meets axis 1 of the output index (`o1`)."""

    FIRST_NUMBER: ClassVar[int] = 100
    count: int = FIRST_NUMBER - 1  # the last number handed out

    def next(self) -> int:
        self.count += 1
        return self.count


@dataclass(eq=False)
class Block:
    """A list of statements being built, with handles for what it declares; `with` blocks nest."""

    numbering: Numbering
    statements: list[Statement] = field(default_factory=list)

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
        self.statements.append(DeclareArray(var, length, tuple(as_expr(v, dtype) for v in init), local, constant))
        return var

    def assign(self, target: Var | Element | Lane, value: Operand, op: str = "=") -> None:
        self.statements.append(Assign(target, as_expr(value, target.dtype), op))

    def add(self, *statements: Statement) -> None:
        self.statements.extend(statements)

    @contextmanager
    def loop(self, kind: str, start: Operand, stop: Operand | None, step: int = 1, unroll: bool = False,
             condition: Callable[[Var], Expr] | None = None, step_op: str = "+=", name: str = ""
             ) -> Iterator[tuple[Var, Block]]:
        """for (kind = start; kind < stop; kind += step), or while `condition(kind)` holds, stepping by `step_op`."""
        var = self.var(kind, INT, name)
        self.statements.append(each := For(var, as_expr(start), None if stop is None else as_expr(stop), [], step,
                                           unroll, condition(var) if condition else None, step_op))
        yield var, Block(self.numbering, each.body)

    @contextmanager
    def when(self, condition: Expr) -> Iterator[Block]:
        yield self.either(condition)[0]

    def either(self, condition: Expr) -> tuple[Block, Block]:
        """if (condition) {..} else {..}: the two blocks to build into."""
        self.statements.append(branch := If(condition, [], []))
        return Block(self.numbering, branch.then), Block(self.numbering, branch.orelse)

    @contextmanager
    def repeat_while(self, condition: Expr) -> Iterator[Block]:
        self.statements.append(loop := While(condition, []))
        yield Block(self.numbering, loop.body)


def walk_expr(expr: Expr) -> Iterator[Expr]:
    """`expr` and every expression inside it, parents first: those among its fields, and in its tuples of
    expressions (call arguments, vector parts)."""
    stack = [expr]  # a stack, not nested generators: each level of `yield from` costs every node below it
    while stack:
        node = stack.pop()
        yield node
        names = _EXPR_FIELDS.get(type(node))
        if names is None:
            names = _EXPR_FIELDS[type(node)] = _expr_fields(type(node))
        children: list[Expr] = []
        for name in names:
            value = getattr(node, name)
            if isinstance(value, Expr):
                children.append(value)
            elif isinstance(value, tuple):
                children.extend(value)
        stack.extend(reversed(children))


#: each Expr class's fields that can hold expressions, in order (walk_expr reads only these: a co-launched 1B
#: step's walks over every node's fields took a third of co_launch.merged)
_EXPR_FIELDS: dict[type, tuple[str, ...]] = {}


def _expr_fields(cls: type) -> tuple[str, ...]:
    """The dataclass fields of `cls` annotated as an expression, a Var, or a tuple or optional of them."""
    return tuple(f.name for f in dataclasses.fields(cls)
                 if any(word in str(f.type).replace("|", " ").replace("[", " ").replace(",", " ").split()
                        for word in ("Expr", "Var")))


#: the fields of a statement that hold the expressions it reads (an Assign's to an Element: its index too)
_READS: dict[type, tuple[str, ...]] = {
    Declare: ("init",), DeclareArray: ("init", "length"), Assign: ("value",), Store: ("texel", "value"),
    For: ("start", "stop", "condition"), If: ("condition",), While: ("condition",), Invoke: ("arguments",)}

#: the fields of a statement that hold the statements nested in it
_BODIES: dict[type, tuple[str, ...]] = {For: ("body",), While: ("body",), If: ("then", "orelse"),
                                        WithFeature: ("then", "orelse"), Stage: ("then",)}


def statement_exprs(statement: Statement) -> tuple[Expr, ...]:
    """The expressions a statement reads (its own, not those of nested statements)."""
    target = getattr(statement, "target", None)
    reads = [target.index] if isinstance(target, Element) else []
    for value in (getattr(statement, name) for name in _READS.get(type(statement), ())):
        reads.extend(value if isinstance(value, tuple) else (value,) if isinstance(value, Expr) else ())
    return tuple(reads)


def nested(statement: Statement) -> tuple[list[Statement], ...]:
    """The statement lists inside a statement: a loop's body, an if's branches."""
    return tuple(getattr(statement, name) for name in _BODIES.get(type(statement), ()))


def walk(statements: Sequence[Statement]) -> Iterator[Statement]:
    """Every statement, nested ones included, in program order."""
    for statement in statements:
        yield statement
        for body in nested(statement):
            yield from walk(body)
