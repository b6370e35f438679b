"""fold_constants: evaluate every node whose inputs are all constants, at compile time.

Rewrite: Shape/Size of static tensors, and every chain over constants (the exporters'
Shape/Gather/Concat/ConstantOfShape/Expand/CastLike chains, computed Pad amounts,
IsNaN/Where masks, rotary tables from buffers, causal masks) becomes one initializer, via
onnxscript's constant folder; nodes that read a `param` initializer are never folded, so
weights stay weights. ConstantOfShape folds too, though onnxscript keeps it by default (to keep
models small): the legacy exporter computes `F.pad` amounts as Concat(amounts,
ConstantOfShape(zeros)) chains, and a Pad whose pads stay unfolded has no static shape.
Unused nodes and initializers are removed.
Preconditions: static input shapes (fix_input_shapes), roles on initializers
(classify_initializers). In place.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import fold_constants

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.passes.contracts import ContractPass

# Folded tensors can be large (an attention mask is seq x seq); fblc folds them all.
_NO_SIZE_LIMIT = 1 << 40


def _reads_param(node: ir.Node) -> bool:
    return any(v is not None and keys.get_role(v) == Role.PARAM.value for v in node.inputs)


def _is_constant(value: ir.Value | None) -> bool:
    if value is None:
        return True
    producer = value.producer()
    return (value.const_value is not None and keys.get_role(value) != Role.PARAM.value) or (
        producer is not None and producer.op_type == "Constant")


def _should_fold(node: ir.Node) -> bool | None:
    """onnxscript's folding decision for `node` (None: its default rules), asked only when every
    input is constant: never through a weight, nor a DequantizeLinear (a quantized weight stays packed until its
    kernel reads it); always for ConstantOfShape, which the default rules skip. fblc has no size limit (above), so
    a large fill folds like any other constant."""
    if _reads_param(node) or (node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx")):
        return False
    if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx"):
        return True
    return None


def _has_foldable_node(graph: ir.Graph) -> bool:
    """Whether any node could fold; a static exporter graph often has none, and the folder costs time."""
    return any(node.op_type in ("Shape", "Size", "Constant") or all(_is_constant(v) for v in node.inputs)
               for node in graph)


class FoldConstants(ContractPass):
    """Fold constant subgraphs, never through a weight (in place)."""

    name = "fold_constants"
    requires_facts = ("static inputs",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not _has_foldable_node(model.graph):
            return ir.passes.PassResult(model, False)
        before = len(model.graph)
        result = fold_constants(
            model,
            onnx_shape_inference=True,
            input_size_limit=_NO_SIZE_LIMIT,
            output_size_limit=_NO_SIZE_LIMIT,
            should_fold=_should_fold,
        )
        common_passes.RemoveUnusedNodesPass()(model)
        return ir.passes.PassResult(model, result.modified or len(model.graph) != before)
