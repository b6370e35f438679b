"""fuse: group the step graph's nodes into kernels.

Rewrite: writes `fblc.kernel` (`k<N>`) on every node that runs in a kernel, and `alias` on
views (Reshape, Flatten, Squeeze, Unsqueeze, Identity) that reuse their input's texture. An
elementwise node joins the kernel of the producer of one of its inputs when it has the same
output shape (one work-item per output element serves both) and every other input is ready
before that kernel starts; a producer may be an elementwise kernel or a contraction
(MatMul, Gemm, Conv, ConvTranspose), whose epilogue it then becomes. All other ops run alone.
Values of a kernel read outside it are its outputs. Preconditions: static shapes; the graph
is topologically sorted. In place; `modified` is true when any annotation changed.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.values import static_shape

ALIAS = "alias"
ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Exp", "Log", "Relu", "Clip", "Sigmoid", "Tanh",
    "Erf", "Sin", "Cos", "Where", "Cast", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or",
    "Not", "Max", "Min", "Sum", "BatchNormalization", "IsNaN", "Abs"})
VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
CONTRACTIONS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})


def kernel_of(node: ir.Node) -> str | None:
    return node.metadata_props.get(keys.KERNEL)


def real_producer(value: ir.Value | None) -> ir.Node | None:
    """The node that computes `value`'s data, looking through views (which share its texture)."""
    producer = value.producer() if value is not None else None
    while producer is not None and producer.op_type in VIEWS and producer.domain == "":
        producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
    return producer


class FuseKernels(ir.passes.InPlacePass):
    """Assign nodes to kernels, fusing elementwise chains into their producers (in place)."""

    name = "fuse"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        nodes = list(model.graph)
        position = {id(n): i for i, n in enumerate(nodes)}
        group_of: dict[int, int] = {}  # node id -> group number
        first_node: dict[int, int] = {}  # group -> position of its first node
        last_node: dict[int, int] = {}
        shape_of_group: dict[int, tuple[int, ...]] = {}
        fusable_group: dict[int, bool] = {}
        assignment: dict[int, str] = {}
        for node in nodes:
            if node.op_type in VIEWS and node.domain == "":
                assignment[id(node)] = ALIAS
                continue
            group = self._joinable_group(node, group_of, first_node, last_node, shape_of_group, fusable_group)
            if group is None:
                group = len(first_node)
                first_node[group] = position[id(node)]
                shape_of_group[group] = static_shape(node.outputs[0])
                fusable_group[group] = node.op_type in ELEMENTWISE or node.op_type in CONTRACTIONS
            group_of[id(node)] = group
            last_node[group] = position[id(node)]
            assignment[id(node)] = f"k{group}"
        modified = False
        for node in nodes:
            if node.metadata_props.get(keys.KERNEL) != assignment[id(node)]:
                node.metadata_props[keys.KERNEL] = assignment[id(node)]
                modified = True
        return ir.passes.PassResult(model, modified)

    @staticmethod
    def _joinable_group(node: ir.Node, group_of: dict[int, int], first_node: dict[int, int],
                        last_node: dict[int, int], shape_of_group: dict[int, tuple[int, ...]],
                        fusable_group: dict[int, bool]) -> int | None:
        if node.op_type not in ELEMENTWISE or node.domain != "" or len(node.outputs) != 1:
            return None
        shape = static_shape(node.outputs[0])
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is None or id(producer) not in group_of:
                continue
            group = group_of[id(producer)]
            if not fusable_group[group] or shape_of_group[group] != shape:
                continue
            ready = True
            for other in node.inputs:
                other_producer = real_producer(other)
                if other_producer is None or id(other_producer) not in group_of:
                    continue
                other_group = group_of[id(other_producer)]
                if other_group != group and last_node[other_group] > first_node[group]:
                    ready = False  # it might depend on this kernel: joining could form a cycle
            if ready:
                return group
        return None
