"""Graph helpers on onnx_ir: static shapes, constants, and an emitter that appends ONNX nodes.

Every pass that adds nodes (loss, autodiff, optimizer) goes through `Emitter`, so names are
unique, nodes carry their stage in metadata, and constants are shared.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.shape_rules import infer_node
from fblc.compiler.values import FLOAT_TYPES, attr, const_array, ints_input, is_float, numel, static_shape

__all__ = ["Emitter", "FLOAT_TYPES", "attr", "const_array", "ints_input", "is_float", "numel", "static_shape"]

def _attribute(name: str, value: Any) -> ir.Attr:
    """A typed attribute; faster than ir.convenience.convert_attributes for the few kinds fblc emits."""
    if isinstance(value, bool | int):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, float):
        return ir.AttrFloat32(name, value)
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, (list, tuple)):
        return ir.AttrInt64s(name, [int(v) for v in value])
    return ir.convenience.convert_attribute(name, value)




class Emitter:
    """Appends nodes to a graph with unique names, a stage tag and shared constants."""

    def __init__(self, graph: ir.Graph, stage: str) -> None:
        self.graph = graph
        self.stage = stage
        self.prefix = stage
        self.origin: str | None = None
        #: when set, nodes go right before this node (rewrites inside the forward); else at the end
        self.anchor: ir.Node | None = None
        self._constants: dict[tuple[Any, ...], ir.Value] = {}

    def _next_number(self) -> int:
        """A number unique within the graph, shared by every Emitter on it (so two emitters never collide)."""
        number = self.graph.meta.get(keys.EMITTER_NAMES, 0) + 1
        self.graph.meta[keys.EMITTER_NAMES] = number
        return number

    def fresh_name(self, hint: str) -> str:
        return f"{self.prefix}/{hint}_{self._next_number()}"

    def op(self, op_type: str, *inputs: ir.Value | None, num_outputs: int = 1, name: str | None = None,
           **attributes: Any) -> ir.Value:
        """Append one node; returns its first output (see `op_multi` for several)."""
        return self.op_multi(op_type, *inputs, num_outputs=num_outputs, name=name, **attributes)[0]

    def op_multi(self, op_type: str, *inputs: ir.Value | None, num_outputs: int = 1, name: str | None = None,
                 **attributes: Any) -> Sequence[ir.Value]:
        attrs = [_attribute(k, v) for k, v in attributes.items() if v is not None]
        node_name = self.fresh_name(op_type)
        outputs = [ir.Value(name=(name if name and i == 0 else f"{node_name}:{i}")) for i in range(num_outputs)]
        node = ir.Node("", op_type, list(inputs), attrs, outputs=outputs, name=node_name)
        node.metadata_props[keys.STAGE] = self.stage
        if self.origin is not None:
            node.metadata_props[keys.GRAD_OF] = self.origin
        if self.anchor is None:
            self.graph.append(node)
        else:
            self.graph.insert_before(self.anchor, node)
        infer_node(node)
        return node.outputs

    def const(self, array: np.ndarray | float | int | Sequence[int], dtype: ir.DataType | None = None) -> ir.Value:
        """A shared initializer holding `array` (cast to `dtype` when given)."""
        data = np.asarray(array)
        if dtype is not None:
            data = data.astype(ir.DataType(dtype).numpy())
        elif data.dtype == np.float64:
            data = data.astype(np.float32)
        elif data.dtype.kind == "i":
            data = data.astype(np.int64)
        key = (data.dtype.str, data.shape, data.tobytes()) if data.size <= 64 else None
        if key is not None and key in self._constants:
            return self._constants[key]
        value = ir.Value(name=f"{self.stage}/const_{self._next_number()}", const_value=ir.tensor(data),
                         shape=ir.Shape(data.shape), type=ir.TensorType(ir.DataType.from_numpy(data.dtype)))
        self.graph.register_initializer(value)
        if key is not None:
            self._constants[key] = value
        return value

    def scalar(self, number: float, like: ir.Value) -> ir.Value:
        """A rank-0 constant of `like`'s dtype."""
        return self.const(np.array(number), dtype=like.dtype)

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64))

    def reshape(self, x: ir.Value, shape: Sequence[int]) -> ir.Value:
        return self.op("Reshape", x, self.ints(shape))

    def reduce_sum(self, x: ir.Value, axes: Sequence[int], keepdims: bool) -> ir.Value:
        if not axes:
            return x
        return self.op("ReduceSum", x, self.ints(axes), keepdims=int(keepdims))

    def unbroadcast(self, grad: ir.Value, grad_shape: Sequence[int], target_shape: Sequence[int]) -> ir.Value:
        """Sum `grad` (of `grad_shape`) over the axes that numpy broadcasting added to `target_shape`."""
        grad_shape, target_shape = tuple(grad_shape), tuple(target_shape)
        if grad_shape == target_shape:
            return grad
        lead = len(grad_shape) - len(target_shape)
        axes = list(range(lead))
        axes += [lead + i for i, d in enumerate(target_shape) if d == 1 and grad_shape[lead + i] != 1]
        if all(axis < lead for axis in axes):  # the sum is of the target's shape: no reshape after it, so an
            return self.reduce_sum(grad, axes, keepdims=False)  # elementwise reader (an update) joins its kernel
        summed = self.reduce_sum(grad, axes, keepdims=True)
        return self.reshape(summed, target_shape)

    def zeros(self, shape: Sequence[int], like: ir.Value) -> ir.Value:
        return self.op("ConstantOfShape", self.ints(shape),
                       value=ir.tensor(np.zeros(1, dtype=ir.DataType(like.dtype).numpy())))


def clone_node(e: Emitter, node: ir.Node, mapping: dict[int, ir.Value], stage: str) -> ir.Node:
    """A copy of `node` appended by `e`, reading `mapping[id(v)]` for each input v it maps (else v),
    with fresh outputs of the same shapes and types and `stage`; `mapping` learns the outputs."""
    inputs = [None if v is None else mapping.get(id(v), v) for v in node.inputs]
    name = e.fresh_name(node.op_type)
    outputs = [ir.Value(name=f"{name}:{i}", shape=None if o.shape is None else ir.Shape(list(o.shape)), type=o.type)
               for i, o in enumerate(node.outputs)]
    clone = ir.Node(node.domain, node.op_type, inputs, list(node.attributes.values()), outputs=outputs, name=name)
    clone.metadata_props[keys.STAGE] = stage
    e.graph.append(clone)
    for old, new in zip(node.outputs, clone.outputs):
        mapping[id(old)] = new
    return clone


def replace_output(old: ir.Value, new: ir.Value, suffix: str = "replaced") -> None:
    """Consumers and graph outputs read `new`, which takes `old`'s name (dumps stay readable); `old` keeps
    it with `/suffix` (what replaced it)."""
    name = old.name
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name, new.name = f"{name}/{suffix}", name
