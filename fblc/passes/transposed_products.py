"""transposed_products: a product read transposed is computed transposed, Y^T = (A B)^T = B^T A^T.

Rewrite: Y = Transpose(P) with P = MatMul(A, B), the Transpose swapping the last two axes (batch axes in
place) and P read by nothing else, becomes Y = MatMul(B', A'): B' = Transpose(B) and A' = Transpose(A), or X
itself where A (or B) is already a swap Transpose of X (the autodiff's X^T of dW = X^T dY). The autodiff writes
this shape for every weight used transposed (a Linear's y = x W^T: dW = (x^T dY)^T): tile_remap would make Y a
strided view of P whose readers (the optimizer update, elementwise) fetch one lane of a texel per element,
where the rewritten product writes Y in its own order and reads its operands in place (MatMul reads strided
operands as whole texels). Applied only where it adds no more Transposes than it removes and tile_remap's check
(`remap_status`) would map each new one as a view, so under rtile no copy kernel is added and under naive
(every Transpose a copy) there are no more of them; both layouts get the same graph.
Y keeps its value (name, shape, readers); P and its Transpose go when nothing else reads them. Preconditions:
static shapes; run before ftd_taxonomy (which labels the new nodes) and tile_remap. In place; `modified` when a
product was rewritten.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, static_shape
from fblc.passes.contracts import ContractPass
from fblc.passes.tile_remap import remap_status


def _swaps_last_two(node: ir.Node) -> bool:
    """Whether `node` is a Transpose that swaps its last two axes and keeps the others in place."""
    if node.op_type != "Transpose" or node.domain != "" or not node.inputs or node.inputs[0] is None:
        return False
    rank = len(static_shape(node.inputs[0]))
    perm = attr(node, "perm", None)
    return rank >= 2 and perm is not None and list(perm) == [*range(rank - 2), rank - 1, rank - 2]


def _candidate(node: ir.Node) -> ir.Node | None:
    """The MatMul P of Y = Transpose(P) that may be computed transposed, or None."""
    if not _swaps_last_two(node):
        return None
    product = node.inputs[0].producer() if node.inputs[0] is not None else None
    if (product is None or product.op_type != "MatMul" or product.domain != ""
            or product.outputs[0].is_graph_output()
            or len(product.outputs[0].uses()) != 1):
        return None
    a, b = product.inputs
    if a is None or b is None or min(len(static_shape(a)), len(static_shape(b))) < 2:
        return None  # a 1-D operand has no last two axes to swap
    return product


def _rewritten(graph: ir.Graph, transpose: ir.Node, product: ir.Node) -> bool:
    """Y = MatMul(B', A') in place of Y = Transpose(MatMul(A, B)) where the module docstring's rule allows; True
    if so."""
    e = Emitter(graph, stage=transpose.metadata_props.get(keys.STAGE, "backward"))
    e.anchor, e.prefix = transpose, f"{transpose.name}/swapped"
    e.origin = transpose.metadata_props.get(keys.GRAD_OF)
    added: list[ir.Node] = []

    def swapped(value: ir.Value) -> ir.Value:
        producer = value.producer()
        if producer is not None and _swaps_last_two(producer):
            return producer.inputs[0]  # type: ignore[return-value]
        rank = len(static_shape(value))
        out = e.op("Transpose", value, perm=[*range(rank - 2), rank - 1, rank - 2])
        added.append(out.producer())  # type: ignore[arg-type]
        return out

    a, b = product.inputs
    result = e.op("MatMul", swapped(b), swapped(a))  # type: ignore[arg-type]
    added.append(result.producer())  # type: ignore[arg-type]
    target = transpose.outputs[0]
    removed = 1 + sum(1 for operand in (a, b) if operand is not None and operand.producer() is not None
                      and _swaps_last_two(operand.producer()) and len(operand.uses()) == 1)  # read only by P
    transposes = [node for node in added if node.op_type == "Transpose"]
    if len(transposes) > removed or static_shape(result) != static_shape(target) or any(
            remap_status(node)[0] != "remapped" for node in transposes):
        for node in reversed(added):  # undo: nothing reads them yet
            graph.remove(node, safe=True)
        return False
    target.replace_all_uses_with(result, replace_graph_outputs=True)  # a weight's gradient is a step output
    name = target.name
    target.name, result.name = f"{name}/transposed", name
    result.metadata_props.update(target.metadata_props)
    graph.remove(transpose, safe=True)
    if not product.outputs[0].uses():
        graph.remove(product, safe=True)
    for operand in (a, b):  # a swap Transpose the rewrite read through, now unread
        producer = operand.producer() if operand is not None else None
        if (producer is not None and _swaps_last_two(producer) and not operand.uses()  # type: ignore[union-attr]
                and not operand.is_graph_output()):  # type: ignore[union-attr]
            graph.remove(producer, safe=True)
    return True


class TransposedProducts(ContractPass):
    """Compute MatMul products that are read transposed in the transposed order (in place)."""

    name = "transposed_products"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            product = _candidate(node)
            if product is not None:
                modified |= _rewritten(graph, node, product)
        return ir.passes.PassResult(model, modified)
