"""lower_composites: rewrite composite ONNX ops into ops fblc differentiates and runs.

Rewrites (`LOWERINGS`, a table keyed by op type; every result has the node's output name):

- GroupNormalization (epsilon e, num_groups G) of X [N, C, ...]: Reshape to [N, G, C/G * ...],
  mean and biased variance over the last axis (ReduceMean, Sub, Mul, ReduceMean), times
  Reciprocal(Sqrt(var + e)), as torch's group_norm. Opset 18-20 (scale and bias of shape [G],
  one per group): the affine is applied per group as [G, 1], then Reshape back. Opset 21 and
  later (shape [C], per channel): Reshape back, then Mul/Add by [C, 1, ..]. stash_type 1 (the
  default) on a non-float32 X computes in float32 between two Casts.
- Einsum: Transpose/Reshape/MatMul/Mul/ReduceSum (`fblc.passes.einsum_lowering`); a label
  repeated within one operand (a diagonal) is refused with UnsupportedOpError.
- DepthToSpace and SpaceToDepth (modes DCR and CRD; SpaceToDepth's mode from opset 28): Reshape,
  Transpose, Reshape, as the ONNX spec defines them.
- Tile with constant repeats r of X [d0, .., dk]: Reshape to [1, d0, 1, d1, ..], Expand to
  [r0, d0, r1, d1, ..], Reshape to [r0 d0, r1 d1, ..] (a 1 is inserted only where r_i != 1).
  Repeats computed at run time: the node stays (infer_shapes then names it, its shape
  depending on data).
- GlobalMaxPool of X [N, C, S..]: MaxPool with kernel_shape S (stride 1, no pads). Not ReduceMax:
  the op is nn.AdaptiveMaxPool2d(1)'s max over the plane, whose torch gradient goes to one element
  of a tie (the first in row-major order, as MaxPool's Indices; the legacy exporter writes that
  module as this very MaxPool), where ReduceMax's rule splits a tie equally (as torch.amax does;
  the dynamo exporter writes the module as ReduceMax, and fblc then follows torch.amax).
- com.microsoft MatMulNBits (onnxruntime's 4/8-bit weights): DequantizeLinear of the packed bytes kept as
  they are, Transpose, MatMul, Add of the bias (`fblc.passes.matmul_nbits`); the opset rises to 21.
- ReduceMin (float): Neg(ReduceMax(Neg X)) over the same axes and keepdims. ReduceMax's rule
  splits a tie's gradient equally, as torch.amin does (what the exporters write ReduceMin for).
  noop_with_empty_axes without axes: X itself (through an Identity). Integer inputs stay.

Preconditions: after fold_constants and eliminate_noops (constant repeats and axes are
initializers), before infer_shapes. The rewrites need the static shapes of their inputs,
which fix_input_shapes cleared and the folder may not have recomputed, so the pass runs onnx's
shape inference itself (not strict), lowers every node whose inputs have static shapes, and
repeats while that makes progress: onnx has no shape inference for GroupNormalization (a
function op), so values below one get their shapes only once it is lowered. A node whose inputs
never get a static shape stays, and infer_shapes names it. In place; `modified` is true when a
node was rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from fblc.compiler.graph import Emitter, attr, const_array, static_shape
from fblc.compiler.shapes import infer_shapes
from fblc.errors import ShapeError, UnsupportedOpError
from fblc.passes.contracts import ContractPass
from fblc.passes.einsum_lowering import lower_einsum
from fblc.passes.matmul_nbits import DOMAIN as NBITS_DOMAIN, drop_unread, lower_matmul_nbits

#: (emitter placed before the node, the node, the model's default-domain opset) -> the value that
#: replaces the node's output, or None to leave the node as it is
Rewrite = Callable[[Emitter, ir.Node, int], "ir.Value | None"]


@dataclass(frozen=True)
class Lowering:
    rewrite: Rewrite
    into: str  # the ops it writes, for docs/OPS.md
    limits: str = ""  # forms it leaves or refuses


def _string(node: ir.Node, name: str, default: str) -> str:
    value = attr(node, name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _group_norm(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    x, scale, bias = node.inputs[:3]
    shape = static_shape(x)
    groups = int(attr(node, "num_groups"))
    channels = shape[1] if len(shape) > 1 else 0
    per_channel = (node.version or opset) >= 21
    want = channels if per_channel else groups
    if len(shape) < 2 or channels % groups:
        raise ShapeError(f"GroupNormalization node '{node.name}': {channels} channels in {groups} groups",
                         "num_groups must divide the channel count (dim 1)")
    for name, value in (("scale", scale), ("bias", bias)):
        if list(static_shape(value)) != [want]:
            raise ShapeError(f"GroupNormalization node '{node.name}': {name} has shape {list(static_shape(value))}, "
                             f"opset {node.version or opset} needs [{want}]",
                             "opset 18-20 take one scale and bias per group, opset 21 one per channel")
    stash = int(attr(node, "stash_type", 1)) == 1 and x.dtype != ir.DataType.FLOAT and (node.version or opset) >= 21
    if stash:
        x = e.op("Cast", x, to=int(ir.DataType.FLOAT))
        scale, bias = e.op("Cast", scale, to=int(ir.DataType.FLOAT)), e.op("Cast", bias, to=int(ir.DataType.FLOAT))
    grouped = e.reshape(x, [shape[0], groups, -1])
    mean = e.op("ReduceMean", grouped, e.ints([2]), keepdims=1)
    centered = e.op("Sub", grouped, mean)
    var = e.op("ReduceMean", e.op("Mul", centered, centered), e.ints([2]), keepdims=1)
    epsilon = float(attr(node, "epsilon", 1e-5))
    normalized = e.op("Mul", centered, e.op("Reciprocal", e.op("Sqrt", e.op("Add", var, e.scalar(epsilon, var)))))
    if per_channel:
        affine_shape = [channels] + [1] * (len(shape) - 2)
        spread = e.reshape(normalized, shape)
        y = e.op("Add", e.op("Mul", spread, e.reshape(scale, affine_shape)), e.reshape(bias, affine_shape))
    else:
        grouped_y = e.op("Add", e.op("Mul", normalized, e.reshape(scale, [groups, 1])), e.reshape(bias, [groups, 1]))
        y = e.reshape(grouped_y, shape)
    return e.op("Cast", y, to=int(node.inputs[0].dtype)) if stash else y


def _einsum(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    return lower_einsum(e, node)


def _depth_to_space(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    n, c, h, w = _rank4(node)
    b = int(attr(node, "blocksize"))
    mode = _string(node, "mode", "DCR")
    if mode == "DCR":
        split, perm = [n, b, b, c // (b * b), h, w], [0, 3, 4, 1, 5, 2]
    elif mode == "CRD":
        split, perm = [n, c // (b * b), b, b, h, w], [0, 1, 4, 2, 5, 3]
    else:
        raise UnsupportedOpError(f"DepthToSpace node '{node.name}' has mode '{mode}'",
                                 "ONNX defines the modes DCR and CRD", ops=["DepthToSpace"])
    moved = e.op("Transpose", e.reshape(node.inputs[0], split), perm=perm)
    return e.reshape(moved, [n, c // (b * b), h * b, w * b])


#: SpaceToDepth's Transpose of [n, c, h / b, bh, w / b, bw] by mode
SPACE_TO_DEPTH_ORDER = {"DCR": [0, 3, 5, 1, 2, 4], "CRD": [0, 1, 3, 5, 2, 4]}


def _space_to_depth(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    n, c, h, w = _rank4(node)
    b = int(attr(node, "blocksize"))
    # output channel (bh, bw, c) in DCR, the default; (c, bh, bw) in CRD (opset 28's mode)
    perm = SPACE_TO_DEPTH_ORDER.get(mode := _string(node, "mode", "DCR"))
    if perm is None:
        raise UnsupportedOpError(f"SpaceToDepth node '{node.name}' has mode '{mode}'",
                                 "ONNX defines the modes DCR and CRD", ops=["SpaceToDepth"])
    moved = e.op("Transpose", e.reshape(node.inputs[0], [n, c, h // b, b, w // b, b]), perm=perm)
    return e.reshape(moved, [n, c * b * b, h // b, w // b])


def _rank4(node: ir.Node) -> tuple[int, int, int, int]:
    shape = static_shape(node.inputs[0])
    if len(shape) != 4:
        raise ShapeError(f"{node.op_type} node '{node.name}' reads a rank-{len(shape)} tensor",
                         "ONNX defines it on [N, C, H, W]")
    return shape[0], shape[1], shape[2], shape[3]


def _tile(e: Emitter, node: ir.Node, opset: int) -> ir.Value | None:
    repeats = const_array(node.inputs[1])
    if repeats is None:
        return None  # computed at run time: left for infer_shapes' data-dependent-shape error
    x = node.inputs[0]
    shape = static_shape(x)
    counts = [int(r) for r in np.asarray(repeats).reshape(-1)]
    split: list[int] = []
    grown: list[int] = []
    for size, count in zip(shape, counts):
        split += [1, size] if count != 1 else [size]
        grown += [count, size] if count != 1 else [size]
    if grown == split:
        return x
    return e.reshape(e.op("Expand", e.reshape(x, split), e.ints(grown)), [n * r for n, r in zip(shape, counts)])


def _global_max_pool(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    spatial = list(static_shape(node.inputs[0])[2:])
    return e.op("MaxPool", node.inputs[0], kernel_shape=spatial)


def _reduce_min(e: Emitter, node: ir.Node, opset: int) -> ir.Value | None:
    x = node.inputs[0]
    if x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16):
        return None
    rank = len(static_shape(x))
    axes_input = node.inputs[1] if len(node.inputs) > 1 else None
    axes = const_array(axes_input) if axes_input is not None else attr(node, "axes")
    if axes_input is not None and axes is None:
        return None  # axes computed at run time
    axes = sorted({int(a) % rank for a in np.asarray(axes if axes is not None else []).reshape(-1)})
    if not axes:
        if int(attr(node, "noop_with_empty_axes", 0)):
            return x
        axes = list(range(rank))
    largest = e.op("ReduceMax", e.op("Neg", x), e.ints(axes), keepdims=int(attr(node, "keepdims", 1)))
    return e.op("Neg", largest)


LOWERINGS: dict[str, Lowering] = {
    "GroupNormalization": Lowering(_group_norm,
                                   "Reshape, ReduceMean, Sub, Mul, Add, Sqrt, Reciprocal (Cast for stash_type)"),
    "Einsum": Lowering(_einsum, "Transpose, Reshape, MatMul, Mul, ReduceSum, Expand",
                       "a label repeated within one operand (diagonal, trace) is refused"),
    "DepthToSpace": Lowering(_depth_to_space, "Reshape, Transpose"),
    "SpaceToDepth": Lowering(_space_to_depth, "Reshape, Transpose"),
    "Tile": Lowering(_tile, "Reshape, Expand", "repeats computed at run time (a data-dependent shape)"),
    "GlobalMaxPool": Lowering(_global_max_pool, "MaxPool"),
    "ReduceMin": Lowering(_reduce_min, "Neg, ReduceMax", "integer inputs, axes computed at run time"),
}


def _matmul_nbits(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    return lower_matmul_nbits(e, node)


#: (domain, op type) -> its lowering, for ops of other domains than ONNX's
DOMAIN_LOWERINGS: dict[tuple[str, str], Lowering] = {
    (NBITS_DOMAIN, "MatMulNBits"): Lowering(_matmul_nbits, "DequantizeLinear (blocked, opset 21), Transpose, MatMul, "
                                            "Add", "g_idx, float zero points, bits other than 4 and 8 are refused"),
}


def lowering_of(node: ir.Node) -> Lowering | None:
    if node.domain in ("", "ai.onnx"):
        return LOWERINGS.get(node.op_type)
    return DOMAIN_LOWERINGS.get((node.domain, node.op_type))


def _inputs_static(node: ir.Node) -> bool:
    return all(v is None or (v.shape is not None and v.shape.is_static() and v.dtype is not None)
               for v in node.inputs)


def _replace(e: Emitter, node: ir.Node, value: ir.Value) -> None:
    """`value` takes the place and the name of the node's output; the node goes."""
    original = node.outputs[0]
    if value.producer() is None or value in node.inputs:  # an input passed through: keep a node for the name
        value = e.op("Identity", value)
    name = original.name
    original.replace_all_uses_with(value, replace_graph_outputs=True)
    original.name, value.name = f"{name}/composite", name
    e.graph.remove(node, safe=True)


class LowerComposites(ContractPass):
    """Rewrite GroupNormalization, Einsum, DepthToSpace, SpaceToDepth, Tile, GlobalMaxPool and
    ReduceMin into primitive ops (in place)."""

    name = "lower_composites"
    requires_facts = ("static inputs",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        pending = [n for n in graph if lowering_of(n) is not None]
        lowered_inputs = {v.name for n in pending for v in n.inputs if v is not None and v.name}
        opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 18)))
        emitter = Emitter(graph, stage="forward")
        modified = False
        while pending:
            infer_shapes(model, require_static=False)
            ready = [n for n in pending if _inputs_static(n)]
            if not ready:
                break
            for node in ready:
                lowering = lowering_of(node)
                assert lowering is not None
                emitter.anchor, emitter.prefix = node, f"{node.name}/lowered"
                value = lowering.rewrite(emitter, node, opset)
                if value is not None:
                    _replace(emitter, node, value)
                    modified = True
            pending = [n for n in pending if n not in ready]
        drop_unread(graph, lowered_inputs)
        if any(n.op_type == "DequantizeLinear" and "block_size" in n.attributes for n in graph) and opset < 21:
            model.opset_imports[""] = 21  # a MatMulNBits lowered: blocked DequantizeLinear is opset 21
        return ir.passes.PassResult(model, modified)
