"""What a reduction's fold reads (kernels/reduce.py): a tensor's texels and elements, computed by a prologue node of
the kernel where one makes it (FoldInput), or several sums' sources at once, the textures they share read once a
step (FoldReads)."""

from __future__ import annotations

from typing import Callable, Union

import onnx_ir as ir

from fblc.codegen.builder import KernelBuilder
from fblc.codegen.ir import Block, Expr, Var
from fblc.codegen.kernels.elementwise import EXPRESSIONS
from fblc.compiler.index_map import view_root
from fblc.compiler.values import numel, static_shape


class FoldInput:
    """What a fold reads: a tensor's texels and elements, or, where a prologue node of the kernel makes it (by id of
    its output: passes/fuse.reduction_prologue), that node's op of its operands' texels and elements (one texel
    of each operand a texel: they have its shape and are read in its order)."""

    def __init__(self, b: KernelBuilder, value: ir.Value, prologue: dict[int, ir.Node],
                 shared: dict[int, Var] | None = None) -> None:
        self.b, self.value, self.prologue, self.shared = b, value, prologue, shared
        self.node = prologue.get(id(view_root(value)))

    def _computed(self, read: Callable[[FoldInput], Expr]) -> Expr:
        assert self.node is not None
        return EXPRESSIONS[self.node.op_type](self.b, self.node,
                                              lambda v: read(FoldInput(self.b, v, self.prologue, self.shared)))

    def _once(self, block: Block | None, read: Expr) -> Expr:
        """`read` of a stored tensor, let once in `block` where several folds of one loop read it (FoldReads)."""
        if self.shared is None or block is None:
            return read
        if id(self.value) not in self.shared:
            self.shared[id(self.value)] = block.let(read, "t")
        return self.shared[id(self.value)]

    def texel(self, texel: Expr, block: Block | None = None) -> Expr:
        """Its whole texel `texel` (a float4)."""
        if self.node is None:
            return self._once(block, self.b.texel(*self.b.input_argument(self.value), texel))
        return self._computed(lambda operand: operand.texel(texel, block))

    def element(self, index: Expr, block: Block | None = None) -> Expr:
        """Its element `index` (flat, row-major)."""
        if self.node is None:
            return self._once(block, self.b.element(self.value, index))
        return self._computed(lambda operand: operand.element(index, block))

    @property
    def texels(self) -> int:
        return self.b.input_argument(self.value)[1].texels if self.node is None else -(-numel(static_shape(self.value))
                                                                                      // 4)

    @property
    def mask(self) -> bool:
        """Whether it is a mask's bits (no 4-element texels to read whole)."""
        return self.node is None and bool(self.b.input_argument(self.value)[1].mask_elements)


class FoldReads:
    """What one loop folds for several sibling sums of one shape and order (fuse_sums): each source's texel or
    element as a tuple, a stored tensor that several of them read (BatchNorm's dy, in sum(dy) and sum(dy * x_hat))
    read once a step and shared, where separate loops read it once per sum: image storage pays each texel read
    (PoCL serves read_imagef through a library call)."""

    def __init__(self, b: KernelBuilder, values: tuple[ir.Value, ...], prologue: dict[int, ir.Node]) -> None:
        self.b, self.values, self.prologue = b, values, prologue
        self.first = FoldInput(b, values[0], prologue)

    def _each(self, read: Callable[[FoldInput], Expr]) -> tuple[Expr, ...]:
        shared: dict[int, Var] = {}
        return tuple(read(FoldInput(self.b, value, self.prologue, shared)) for value in self.values)

    def texel(self, texel: Expr, block: Block | None = None) -> tuple[Expr, ...]:  # type: ignore[override]
        return self._each(lambda each: each.texel(texel, block))

    def element(self, index: Expr, block: Block | None = None) -> tuple[Expr, ...]:  # type: ignore[override]
        return self._each(lambda each: each.element(index, block))

    @property
    def texels(self) -> int:
        return self.first.texels

    @property
    def mask(self) -> bool:
        return any(FoldInput(self.b, value, self.prologue).mask for value in self.values)


Read = Union[FoldInput, FoldReads]
Folds = Union[Expr, tuple[Expr, ...]]  # what a step folds: one value, or FoldReads' one per sum


def let_each(block: Block, value: Folds, kind: str) -> Folds:
    """`value` let in `block`, each of FoldReads' tuple in turn."""
    return tuple(block.let(each, kind) for each in value) if isinstance(value, tuple) else block.let(value, kind)


def lane_each(value: Folds, lane: int) -> Folds:
    """Lane `lane` of a float4 `value`, or of each of FoldReads' tuple."""
    return tuple(each.lane(lane) for each in value) if isinstance(value, tuple) else value.lane(lane)
