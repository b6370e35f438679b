"""quantize_weights: store frozen MatMul/Gemm weights as int8/int4 groups or fp16 (--weights).

Rewrite, with --weights int8|int4: each `frozen` float 2-D initializer W that is read only as the B operand
of MatMul or Gemm (directly, or through Transpose perm [1, 0]: the dynamo exporter's Linear) becomes
DequantizeLinear(q, scale, axis=a, block_size=g) (opset 21) in W's place: q the signed integers
(fblc.compiler.quantize, groups of --weight-group along the reduction axis a), scale float32 values that fp16
holds exactly, stored as fp16 on the device (`fblc.storage`). With --weights fp16: W's values are rounded to fp16
(still a float tensor, so the graph and onnxruntime compute with what the device holds) and stored in a half
texture, which its contractions read as any float texture: no Cast, no float copy. Never a trainable weight (role `param`) and never an adapter's factor (LoRA A/B,
MemFLoRA P/U, FuRA-S R: `fblc.adapter_factor`, set where adapters make them). Each quantized weight's
relative Frobenius error ||W - deq(q)|| / ||W|| is recorded in the model metadata (`fblc.quantized`), which
report.json gives. The default domain's opset rises to 21 where it was lower (the blocked form).
Preconditions: roles final (mark_trainable); static shapes. In place; `modified` when a weight was rewritten.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.quantize import STORED_AS, WeightFormat, group_of, quantize_sliced, relative_error
from fblc.compiler.values import attr, static_shape
from fblc.passes.contracts import ContractPass

QUANTIZED, ADAPTER_FACTOR = keys.QUANTIZED, keys.ADAPTER_FACTOR
BLOCKED_OPSET = 21  # DequantizeLinear's block_size


def _reduction_axis(use: ir.Usage) -> int | None:
    """The axis of the stored 2-D weight that `use` reduces over, where `use` reads it as a contraction's B
    (MatMul's [K, N] input 1, Gemm's input 1 by transB, or either through Transpose perm [1, 0]); else None."""
    node, transposed = use.node, False
    if node.op_type == "Transpose" and node.domain == "" and list(attr(node, "perm", [1, 0])) == [1, 0]:
        readers = node.outputs[0].uses()
        if len(readers) != 1:
            return None
        node, transposed = readers[0].node, True
        use = readers[0]
    if node.domain != "" or use.idx != 1 or node.op_type not in ("MatMul", "Gemm"):
        return None
    if node.op_type == "Gemm":
        transposed ^= bool(int(attr(node, "transB", 0)))
    return 1 if transposed else 0


def _candidate(value: ir.Value) -> int | None:
    """The reduction axis of a frozen float weight that only contractions read as B; else None."""
    if keys.get_role(value) != Role.FROZEN.value or value.const_value is None or ADAPTER_FACTOR in value.metadata_props:
        return None
    if value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16) or len(static_shape(value)) != 2:
        return None
    if value.is_graph_input() or value.is_graph_output() or not value.uses():
        return None
    axes = {_reduction_axis(use) for use in value.uses()}
    return axes.pop() if len(axes) == 1 and None not in axes else None


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol, weight: str, storage: str | None = None
                 ) -> ir.Value:
    """A frozen initializer standing for (part of) `weight`; a float one stored in `storage`, which
    storage_precision keeps."""
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    keys.set_role(value, Role.FROZEN)
    value.metadata_props[QUANTIZED] = weight
    if storage:
        value.metadata_props[keys.STORAGE] = storage
    graph.register_initializer(value)
    return value


def _replace(graph: ir.Graph, weight: ir.Value, node: ir.Node) -> None:
    """`node`'s output in every place that read `weight`, which leaves the graph."""
    first_reader = min((use.node for use in weight.uses()), key=list(graph).index)
    graph.insert_before(first_reader, node)
    out = node.outputs[0]
    out.shape, out.type = weight.shape, ir.TensorType(ir.DataType.FLOAT)
    out.metadata_props[QUANTIZED] = weight.name
    for use in list(weight.uses()):
        if use.node is not node:
            use.node.replace_input_with(use.idx, out)
    graph.initializers.pop(weight.name)


class QuantizeWeights(ContractPass):
    """Frozen contraction weights in --weights' storage (in place)."""

    name = "quantize_weights"
    requires_facts = ("trainable inputs",)

    def __init__(self, weights: WeightFormat) -> None:
        super().__init__()
        weights.validate()
        self.weights = weights

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.weights.weights == "fp32":
            return ir.passes.PassResult(model, False)
        graph = model.graph
        records = []
        for weight in list(graph.initializers.values()):
            axis = _candidate(weight)
            if axis is None:
                continue
            w = weight.const_value.numpy()  # type: ignore[union-attr]  # external data: memory-mapped
            if self.weights.weights == "fp16":  # fp16 values in a half texture, which the contraction reads
                half = np.asarray(w, np.float32).astype(np.float16).astype(np.float32)
                weight.const_value = ir.tensor(half, name=weight.name)
                weight.metadata_props[QUANTIZED], weight.metadata_props[keys.STORAGE] = weight.name, "fp16"
                records.append({"weight": weight.name, "shape": list(w.shape), "format": "fp16",
                                "error": relative_error(w, half)})
                continue
            dtype, group = STORED_AS[self.weights.weights], group_of(w.shape[axis], self.weights.group)
            q, scale, error = quantize_sliced(w, axis, group, dtype)  # bounded temporaries: a 1B model's weights
            q_value = _initializer(graph, f"{weight.name}.q", ir.tensor(q, dtype=dtype), weight.name)
            scale_value = _initializer(graph, f"{weight.name}.scale", ir.tensor(scale), weight.name, "fp16")
            _replace(graph, weight, ir.node("DequantizeLinear", [q_value, scale_value],
                                            {"axis": axis, "block_size": group}, name=f"{weight.name}.dequantize",
                                            num_outputs=1))
            records.append({"weight": weight.name, "shape": list(w.shape), "format": self.weights.weights,
                            "axis": axis, "group": group,
                            "error": error})
        if not records:
            return ir.passes.PassResult(model, False)
        if self.weights.quantized and model.opset_imports.get("", BLOCKED_OPSET) < BLOCKED_OPSET:
            model.opset_imports[""] = BLOCKED_OPSET
        model.metadata_props[QUANTIZED] = json.dumps(records)
        return ir.passes.PassResult(model, True)
