"""Nodes that Apache TVM imports wrongly or cannot build, rewritten into equivalent primitive ops.

REWRITES is keyed by op type; each rule says why, for which TVM targets it applies, and emits the
replacement nodes, which keep the original output names (so values compare by name before and
after). `prepare` applies the table and lists every rewrite it made; `check_rewrites` runs the
original and the rewritten step on onnxruntime and raises when any output differs. Found on TVM
0.27 (apache-tvm on PyPI) with fblc's steps of exported models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from fblc.compiler.reference import run_model
from fblc.errors import FblcError

CPU_TARGET = "llvm"
OPENCL_TARGET = "qcom/adreno-opencl-texture"  # TVM's Adreno pipeline with textures
PLAIN_OPENCL_TARGET = "qcom/adreno-opencl"  # the same without textures, where that one fails
EVERY_TARGET = (CPU_TARGET, OPENCL_TARGET, PLAIN_OPENCL_TARGET)
OPENCL_TARGETS = (OPENCL_TARGET, PLAIN_OPENCL_TARGET)


@dataclass(frozen=True)
class AppliedRewrite:
    node: str
    op_type: str
    why: str

    def __str__(self) -> str:
        return f"{self.op_type} '{self.node}': {self.why}"


class _Emitter:
    """Replacement nodes and constants for one rewritten node, named under the node's name."""

    def __init__(self, node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]], types: Mapping[str, int]) -> None:
        self.node, self.shapes, self.types = node, shapes, types
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []

    def constant(self, array: np.ndarray) -> str:
        name = f"{self.node.name}/tvm/c{len(self.constants)}"
        self.constants.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attributes: object) -> str:
        out = output or f"{self.node.name}/tvm/{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{out}/node", **attributes))
        return out


def _attribute(node: onnx.NodeProto, name: str, default: object) -> object:
    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


def _layer_norm(e: _Emitter) -> None:
    """ONNX's definition, op by op: Mean, D = X - Mean, InvStdDev = 1 / sqrt(mean(D^2) + eps), Y."""
    node = e.node
    x, scale = node.input[0], node.input[1]
    rank = len(e.shapes[x])
    axis = int(_attribute(node, "axis", -1)) % rank
    axes = e.constant(np.arange(axis, rank, dtype=np.int64))
    outputs = list(node.output) + [""] * (3 - len(node.output))
    mean = e.op("ReduceMean", [x, axes], outputs[1] or None, keepdims=1)
    centred = e.op("Sub", [x, mean])
    variance = e.op("ReduceMean", [e.op("Mul", [centred, centred]), axes], keepdims=1)
    epsilon = e.constant(np.asarray(float(_attribute(node, "epsilon", 1e-5)), np.float32))
    inverse = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [variance, epsilon])])], outputs[2] or None)
    has_bias = len(node.input) > 2 and bool(node.input[2])
    scaled = e.op("Mul", [e.op("Mul", [centred, inverse]), scale], None if has_bias else outputs[0])
    if has_bias:
        e.op("Add", [scaled, node.input[2]], outputs[0])


def _max_pool_with_indices(e: _Emitter) -> None:
    """The window's first maximum in row-major order (onnxruntime's), over k strided slices of the
    input padded with the lowest float, and the flat input index of each from a padded index table."""
    node, shape = e.node, e.shapes[e.node.input[0]]
    spatial = len(shape) - 2
    kernel = [int(k) for k in _attribute(node, "kernel_shape", [])]
    strides = [int(s) for s in _attribute(node, "strides", [1] * spatial)]
    dilations = [int(d) for d in _attribute(node, "dilations", [1] * spatial)]
    pads = [int(p) for p in _attribute(node, "pads", [0] * 2 * spatial)]
    axes = e.constant(np.arange(2, 2 + spatial, dtype=np.int64))
    padding = e.constant(np.asarray([0, 0, *pads[:spatial], 0, 0, *pads[spatial:]], np.int64))
    values = e.op("Pad", [node.input[0], padding, e.constant(np.asarray(np.finfo(np.float32).min, np.float32))])
    flat = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    indices = e.op("Pad", [e.constant(flat), padding, e.constant(np.asarray(-1, np.int64))])
    outs = [(shape[2 + a] + pads[a] + pads[spatial + a] - (kernel[a] - 1) * dilations[a] - 1) // strides[a] + 1
            for a in range(spatial)]
    steps = e.constant(np.asarray(strides, np.int64))
    best = best_index = ""
    for offset in np.ndindex(*kernel):
        starts = [o * d for o, d in zip(offset, dilations)]
        bounds = [e.constant(np.asarray(starts, np.int64)),
                  e.constant(np.asarray([b + (n - 1) * s + 1 for b, n, s in zip(starts, outs, strides)], np.int64)),
                  axes, steps]
        value, index = e.op("Slice", [values, *bounds]), e.op("Slice", [indices, *bounds])
        if not best:
            best, best_index = value, index
            continue
        larger = e.op("Greater", [value, best])
        best, best_index = e.op("Where", [larger, value, best]), e.op("Where", [larger, index, best_index])
    e.op("Identity", [best], node.output[0])
    e.op("Identity", [best_index], node.output[1])


def _scatter_add_as_sum(e: _Emitter) -> None:
    """data + sum over the scattered axis of (index == position) * update: every update compared with
    every position of its line, so K x D values where the scatter reads K (TVM's GPU schedules have
    no rule for the scatter's serial loop)."""
    data, indices, updates = e.node.input
    rank = len(e.shapes[indices])
    axis = int(_attribute(e.node, "axis", 0)) % rank
    length = e.shapes[data][axis]
    inner = e.constant(np.asarray([axis + 1], np.int64))
    wrapped = e.op("Where", [e.op("Less", [indices, e.constant(np.asarray(0, np.int64))]),
                             e.op("Add", [indices, e.constant(np.asarray(length, np.int64))]), indices])
    positions = e.constant(np.arange(length, dtype=np.int64).reshape([length if a == axis + 1 else 1
                                                                      for a in range(rank + 1)]))
    hits = e.op("Equal", [e.op("Unsqueeze", [wrapped, inner]), positions])
    zero = e.constant(np.asarray(0, helper.tensor_dtype_to_np_dtype(e.types[updates])))
    spread = e.op("Where", [hits, e.op("Unsqueeze", [updates, inner]), zero])
    summed = e.op("ReduceSum", [spread, e.constant(np.asarray([axis], np.int64))], keepdims=0)
    e.op("Add", [data, summed], e.node.output[0])


def _summable_scatter(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """An additive ScatterElements whose indices span the data's other axes whole."""
    data, indices = shapes.get(node.input[0]), shapes.get(node.input[1])
    if _attribute(node, "reduction", b"none") != b"add" or data is None or indices is None:
        return False
    if len(data) != len(indices):
        return False
    axis = int(_attribute(node, "axis", 0)) % len(data)
    return all(d == i for a, (d, i) in enumerate(zip(data, indices)) if a != axis)


def _sum_as_adds(e: _Emitter) -> None:
    total = e.node.input[0]
    for index, addend in enumerate(e.node.input[1:], start=2):
        total = e.op("Add", [total, addend], e.node.output[0] if index == len(e.node.input) else None)
    if len(e.node.input) == 1:
        e.op("Identity", [total], e.node.output[0])


def _constant_as_tensor(e: _Emitter) -> None:
    attribute = e.node.attribute[0]
    value = np.asarray(helper.get_attribute_value(attribute),
                       np.int64 if attribute.name.startswith("value_int") else np.float32)
    e.nodes.append(helper.make_node("Constant", [], [e.node.output[0]], name=e.node.name,
                                    value=numpy_helper.from_array(value)))


def _select(comparison: str) -> Callable[[_Emitter], None]:
    def rewrite(e: _Emitter) -> None:
        a, b = e.node.input
        e.op("Where", [e.op(comparison, [a, b]), a, b], e.node.output[0])
    return rewrite


@dataclass(frozen=True)
class Rule:
    why: str
    targets: tuple[str, ...]
    applies: Callable[[onnx.NodeProto, Mapping[str, tuple[int, ...]]], bool]
    emit: Callable[[_Emitter], None]


def _max_pool_rewritable(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    return (len(node.output) > 1 and bool(node.output[1]) and _attribute(node, "ceil_mode", 0) == 0
            and _attribute(node, "storage_order", 0) == 0 and _attribute(node, "auto_pad", b"NOTSET") == b"NOTSET")


_CONVERT_LAYOUT = "the Adreno pipeline's ConvertLayout dies of SIGFPE (rank 0) or rejects the layout (rank 1) on "

REWRITES: dict[str, Rule] = {
    "LayerNormalization": Rule(
        "TVM's importer computes only Y, and fblc's LayerNorm gradient reads the saved Mean and InvStdDev",
        EVERY_TARGET, lambda node, shapes: sum(bool(o) for o in node.output) > 1, _layer_norm),
    "MaxPool": Rule("TVM's importer makes only Y, and fblc's MaxPool gradient scatters through the Indices output",
                    EVERY_TARGET, _max_pool_rewritable, _max_pool_with_indices),
    "Constant": Rule(
        "TVM's importer reads a Constant's `value` only, not value_ints / value_floats and the like", EVERY_TARGET,
        lambda node, shapes: node.attribute[0].name in ("value_int", "value_ints", "value_float", "value_floats"),
        _constant_as_tensor),
    "Max": Rule(_CONVERT_LAYOUT + "maximum", OPENCL_TARGETS, lambda node, shapes: len(node.input) == 2,
                _select("Greater")),
    "Min": Rule(_CONVERT_LAYOUT + "minimum", OPENCL_TARGETS, lambda node, shapes: len(node.input) == 2,
                _select("Less")),
    "Sum": Rule("the Adreno pipeline's ConvertLayout rejects a variadic sum of rank-4 tensors ('Invalid SLayout')",
                OPENCL_TARGETS, lambda node, shapes: True, _sum_as_adds),
    "ScatterElements": Rule(
        "TVM's GPU schedules (dlight) fail on the scatter's serial loop ('Cannot find a block with the name: root')",
        OPENCL_TARGETS, _summable_scatter, _scatter_add_as_sum),
}


def _shapes_and_types(model: onnx.ModelProto) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    typed = onnx.shape_inference.infer_shapes(model)
    values = [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]
    shapes = {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
              for v in values if v.type.tensor_type.HasField("shape")}
    shapes.update({t.name: tuple(t.dims) for t in model.graph.initializer})
    types = {v.name: v.type.tensor_type.elem_type for v in values}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return shapes, types


def prepare(step: onnx.ModelProto, target: str) -> tuple[onnx.ModelProto, list[AppliedRewrite]]:
    """`step` with every REWRITES rule for `target` applied, and the list of what was rewritten."""
    rules = {op: rule for op, rule in REWRITES.items() if target in rule.targets}
    if not any(n.op_type in rules for n in step.graph.node):
        return step, []
    shapes, types = _shapes_and_types(step)
    model = onnx.ModelProto()
    model.CopyFrom(step)
    del model.graph.node[:]
    applied = []
    for node in step.graph.node:
        rule = rules.get(node.op_type)
        if rule is None or not rule.applies(node, shapes):
            model.graph.node.append(node)
            continue
        emitter = _Emitter(node, shapes, types)
        rule.emit(emitter)
        model.graph.node.extend(emitter.nodes)
        model.graph.initializer.extend(emitter.constants)
        applied.append(AppliedRewrite(node.name, node.op_type, rule.why))
    return model, applied


def check_rewrites(step: onnx.ModelProto, target: str, feeds: Mapping[str, np.ndarray]) -> list[AppliedRewrite]:
    """Raise unless onnxruntime gives every output of the rewritten step as it does the original's."""
    model, applied = prepare(step, target)
    if not applied:
        return applied
    before, after = run_model(step, feeds), run_model(model, feeds)
    for name, value in before.items():
        if not np.allclose(value, after[name], rtol=1e-5, atol=1e-6):
            raise FblcError(f"the rewrites for TVM change output '{name}' (by up to "
                            f"{float(np.abs(np.asarray(value, np.float64) - after[name]).max()):.3g}): "
                            + "; ".join(str(a) for a in applied), "fix the rule in fblc/baselines/tvm_rewrites.py")
    return applied
