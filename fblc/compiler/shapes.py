"""Strict shape inference: onnx's C++ inference over a weightless copy, merged back into the IR."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from fblc.compiler.errors import ShapeError

_INLINE_LIMIT = 1024  # bytes; larger initializers go to inference as typed inputs, without data


def _weightless_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as a proto whose large initializers are typed graph inputs without data.

    Shape inference needs only their types; serialising gigabytes of weights (or computing
    lazy optimizer state) would cost more than the inference itself.
    """
    graph = model.graph
    detached = {name: v.const_value for name, v in graph.initializers.items()
                if v.const_value is not None and v.const_value.nbytes > _INLINE_LIMIT}
    for name in detached:
        graph.initializers[name].const_value = None
    serde_logger = logging.getLogger("onnx_ir.serde")
    level = serde_logger.level
    serde_logger.setLevel(logging.ERROR)  # it warns about each initializer left without data
    try:
        proto = ir.to_proto(model)
    finally:
        serde_logger.setLevel(level)
        for name, tensor in detached.items():
            graph.initializers[name].const_value = tensor
    declared = {i.name for i in proto.graph.input}
    for name in detached:
        if name not in declared:
            value = graph.initializers[name]
            proto.graph.input.append(onnx.helper.make_tensor_value_info(name, int(value.dtype), list(value.shape)))
    return proto


def infer_shapes(model: ir.Model, require_static: bool = True) -> bool:
    """Infer the shape and dtype of every value; raise ShapeError naming the first value left unknown."""
    try:
        inferred = onnx.shape_inference.infer_shapes(_weightless_proto(model), check_type=True,
                                                     strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as error:
        first_line = str(error).strip().splitlines()[0]
        raise ShapeError(f"shape inference failed: {first_line}",
                         "check --input-shape against what the model expects") from None
    found = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    modified = False
    for node in model.graph:
        for value in node.outputs:
            info = found.get(value.name)
            if info is not None and info.type.HasField("tensor_type"):
                tensor_type = info.type.tensor_type
                dtype = ir.DataType(tensor_type.elem_type) if tensor_type.elem_type else None
                shape = None
                if tensor_type.HasField("shape"):
                    shape = ir.Shape([d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                      for d in tensor_type.shape.dim])
                if dtype is not None and value.dtype != dtype:
                    value.dtype = dtype
                    modified = True
                if shape is not None and value.shape != shape:
                    value.shape = shape
                    modified = True
            if require_static and (value.shape is None or not value.shape.is_static() or value.dtype is None):
                raise ShapeError(
                    f"cannot infer a static shape for '{value.name}', output of node '{node.name}' ({node.op_type})",
                    "pass --input-shape for every dynamic input; if that is done, this op's shape depends on data")
    return modified
