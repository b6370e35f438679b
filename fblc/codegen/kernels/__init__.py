"""Kernel emitters by table: one registry keyed by the op type that anchors a kernel.

An emitter gets the TextureTable and a KernelGroup (its nodes, in order, and the values the
rest of the step reads) and returns the OpenCL kernels that compute them; `lane_kernel` registers the
common kind, one per-element kernel whose lane results a function builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Callable, Collection, Sequence

import onnx_ir as ir

from fblc.codegen.cl import Kernel, strides_of
from fblc.codegen.indexing import index_var
from fblc.codegen.ir import Expr, Var, flat_index
from fblc.codegen.reads import OUT_INDEX
from fblc.codegen.textures import TextureTable
from fblc.compiler.registry import OpRegistry

if TYPE_CHECKING:
    from fblc.codegen.builder import KernelBuilder


@dataclass
class KernelGroup:
    name: str
    nodes: list[ir.Node]
    outputs: list[ir.Value]  # values read outside the group, or graph outputs

    @property
    def anchor(self) -> ir.Node:
        return self.nodes[0]


Emitter = Callable[[TextureTable, KernelGroup], list[Kernel]]
#: (builder of a group's kernel, its anchor node) -> the lane's results, one per output of the group
LaneResults = Callable[["KernelBuilder", ir.Node], list[Expr]]


#: the modules whose emitters register themselves on import
EMITTER_MODULES = ("activations", "contraction", "conv", "conv_transpose", "dequantize", "elementwise", "gather", "movement",
                   "noise", "normalize", "pooling", "reduce", "resample", "scan", "sort")


def _load_emitters() -> None:
    for module in EMITTER_MODULES:
        import_module(f".{module}", __name__)


KERNEL_EMITTERS: OpRegistry[Emitter] = OpRegistry(
    "OpenCL kernel emitter", "this op cannot run on the GPU yet", loader=_load_emitters)
register_kernel = KERNEL_EMITTERS.register


def lane_kernel(family: str, *op_types: str) -> Callable[[LaneResults], LaneResults]:
    """Register for `op_types` the emitter of one per-element kernel of `family` (the kernel modules'
    common start-up and finish), whose lane results the decorated function builds."""
    def decorate(build: LaneResults) -> LaneResults:
        def emit(table: TextureTable, group: KernelGroup) -> list[Kernel]:
            from fblc.codegen.builder import KernelBuilder  # not at the top: builder -> schedule -> this package
            b = KernelBuilder.for_group(table, group, family)
            return [b.finish(build(b, group.anchor))]

        register_kernel(*op_types)(emit)
        return build

    return decorate


def out_axis(axis: int) -> Var:
    """Axis `axis` of the current output element's multi-index (`o0, o1..`, declared by the lane loop)."""
    return index_var(OUT_INDEX, axis)


def own_index(shape: Sequence[int], skip: Collection[int] = (), prefix: str = OUT_INDEX) -> Expr:
    """Flat index of the current output element (or of the multi-index `prefix0..`) in a tensor of `shape`,
    with the coordinates on the axes in `skip` taken as 0."""
    return flat_index([(index_var(prefix, k), stride) for k, stride in enumerate(strides_of(shape)) if k not in skip])
