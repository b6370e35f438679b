"""pointwise_transposes: a 1x1 ConvTranspose over planes that texels straddle becomes a Conv with W packed transposed.

Rewrite: dX = ConvTranspose(dY, W) with W [C_in, C_out, 1, ..] (group 1, stride 1, no padding, dilation or
output padding, no bias: a 1x1 Conv's input gradient) becomes dX = Conv(dY, Wt), Wt = Transpose(W) [C_out,
C_in, 1, ..] kept a copy (tile_remap.PACKED): the weights packed the way this reader wants them. A frozen W
(a constant, not a trained graph input) is packed at compile time instead: Wt is a new initializer; a quantized
frozen W (DequantizeLinear of constants, quantize_weights) becomes a DequantizeLinear of its integers and scales
transposed at compile time (the same values), which the Conv dequantizes as it loads it.
Why: a texel holds 4 consecutive elements of the last axis. The transposed kernel sums over C_in with a tile of
output channels; it reads W[c, o..o+3] as one texel only where its tile's rows are consecutive channels, which
needs each channel's plane to be a whole number of texels (plane % 4 == 0: kernels/conv_schedules.channel_rows).
Otherwise (MobileNetV2 at 97 x 60: planes 49 x 30 and 25 x 15) its rows are 4 channels apart and every weight
fetch keeps one float of four: 6 % of that step's texel fetches. A plane of 1 or 2 is left alone: a texel then
holds whole planes of consecutive channels, whose weights the ConvTranspose's lanes read side by side in W
(MobileNetV2 [1,3,32,32]: its 1 x 1 maps' 7 copies were 0.38M of 4.79M image reads a step). The Conv reads Wt[o, c..c+3], whole texels
along its reduction, whatever the plane; the copy is one launch of C_in * C_out elements per step (W trains),
against weight reads repeated by every work-item (a frozen W's costs nothing per step).
dX keeps its value (name, shape, readers). Preconditions: static shapes; run before ftd_taxonomy (which labels
the new nodes) and tile_remap (which keeps the packed Transpose a copy). In place; `modified` when one was
rewritten.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, replace_output, static_shape
from fblc.compiler.values import const_array
from fblc.passes.contracts import ContractPass
from fblc.passes.tile_remap import PACKED

LANES = 4  # elements per texel


def _pointwise(node: ir.Node) -> bool:
    """Whether `node` is a 1x1 ConvTranspose that is a plain channel contraction whose planes texels straddle."""
    if node.op_type != "ConvTranspose" or node.domain != "" or len(node.inputs) < 2 or None in node.inputs[:2]:
        return False
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return False  # a bias: the Conv would add it too, but no autodiff input gradient has one
    w_shape, y_shape = static_shape(node.inputs[1]), static_shape(node.outputs[0])
    spatial = len(w_shape) - 2
    plain = [1] * spatial

    def ints(name: str, default: list[int]) -> list[int]:
        value = attr(node, name, None)
        return default if value is None else list(value)

    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    return (spatial >= 1 and int(attr(node, "group", 1)) == 1 and list(w_shape[2:]) == plain
            and auto_pad in ("NOTSET", "VALID") and attr(node, "output_shape", None) is None
            and ints("strides", plain) == plain and ints("dilations", plain) == plain
            and ints("pads", [0] * 2 * spatial) == [0] * 2 * spatial
            and ints("output_padding", [0] * spatial) == [0] * spatial
            and _straddled(math.prod(y_shape[2:])))


def _straddled(plane: int) -> bool:
    """Whether texels straddle channel planes of `plane` elements: neither whole texels per plane nor whole
    planes per texel (a plane of 1 or 2: a last stage's 1 x 1 map, whose texel holds consecutive channels that
    the ConvTranspose's lanes read side by side in W, as whole texels, without a copy)."""
    return plane % LANES != 0 and LANES % plane != 0


def _rewrite(graph: ir.Graph, node: ir.Node) -> None:
    e = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "backward"))
    e.anchor, e.prefix = node, f"{node.name}/packed"
    e.origin = node.metadata_props.get(keys.GRAD_OF)
    dy, w = node.inputs[0], node.inputs[1]
    rank = len(static_shape(w))
    perm = [1, 0, *range(2, rank)]
    frozen = None if w.is_graph_input() else const_array(w)  # a trained weight is a graph input (its role PARAM)
    quantized = _quantized(w)
    if frozen is not None:  # packed once, at compile time
        packed = e.const(np.ascontiguousarray(frozen.transpose(perm)))
    elif quantized is not None:  # a quantized frozen weight: its integers and scales packed at compile time
        packed = _transposed_dequantize(graph, quantized, perm, node)
    else:  # packed each step, by a copy kernel
        packed = e.op("Transpose", w, perm=perm)
        packed.producer().metadata_props[keys.REMAP] = PACKED  # type: ignore[union-attr]
    dx = e.op("Conv", dy, packed, kernel_shape=[1] * (rank - 2))
    target = node.outputs[0]
    replace_output(target, dx, "transposed")
    dx.metadata_props.update(target.metadata_props)
    graph.remove(node, safe=True)


def _quantized(w: ir.Value) -> ir.Node | None:
    """The DequantizeLinear that makes frozen weight `w` from constant integers and scales (quantize_weights), or
    None."""
    producer = w.producer()
    if producer is None or producer.op_type != "DequantizeLinear" or producer.domain not in ("", "ai.onnx"):
        return None
    inputs = [v for v in producer.inputs if v is not None]
    return producer if all(not v.is_graph_input() and v.const_value is not None for v in inputs) else None


def _transposed_dequantize(graph: ir.Graph, dequantize: ir.Node, perm: list[int], anchor: ir.Node) -> ir.Value:
    """DequantizeLinear of the integers (and scales, zero points) of `dequantize` transposed by `perm` (axes 0 and
    1 swapped): W^T as the same quantized values, never a float copy, which the Conv dequantizes as it loads it
    (fuse.IN_READERS). New frozen initializers, marked as `dequantize`'s were (keys.QUANTIZED, fp16 scales)."""
    axis = int(attr(dequantize, "axis", 1)) % len(perm)
    transposed = []
    for index, value in enumerate(dequantize.inputs):
        if value is None:
            continue
        array = value.const_value.numpy()  # type: ignore[union-attr]
        array = np.ascontiguousarray(array.transpose(perm)) if array.ndim == len(perm) else array  # per axis: as is
        copy = ir.Value(name=f"{value.name}.transposed", shape=ir.Shape(array.shape), type=ir.TensorType(value.dtype),
                        const_value=ir.tensor(array, dtype=value.dtype, name=f"{value.name}.transposed"))
        copy.metadata_props.update(value.metadata_props)
        graph.register_initializer(copy)
        transposed.append(copy)
    attributes = {"axis": perm[axis]}
    if "block_size" in dequantize.attributes:
        attributes["block_size"] = int(attr(dequantize, "block_size", 0))
    node = ir.node("DequantizeLinear", transposed, attributes, name=f"{dequantize.name}.transposed", num_outputs=1)
    graph.insert_before(anchor, node)
    out = node.outputs[0]
    w_shape = static_shape(dequantize.outputs[0])
    out.shape, out.type = ir.Shape([w_shape[p] for p in perm]), ir.TensorType(ir.DataType.FLOAT)
    out.name = f"{dequantize.outputs[0].name}.transposed"
    out.metadata_props.update(dequantize.outputs[0].metadata_props)
    node.metadata_props.update({k: v for k, v in dequantize.metadata_props.items() if k == keys.STAGE})
    return out


class PointwiseTransposes(ContractPass):
    """Turn 1x1 ConvTransposes over planes texels straddle into Convs reading a transposed copy of W (in place)."""

    name = "pointwise_transposes"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        nodes = [node for node in graph if _pointwise(node)]
        for node in nodes:
            _rewrite(graph, node)
        return ir.passes.PassResult(model, bool(nodes))
