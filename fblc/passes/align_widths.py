"""align_widths: feature maps whose width texels straddle are computed a few columns wider, so rows start on texels.

Rewrite: a Conv whose output's last (width) axis W is no multiple of 4, where rounding it up to W4 adds at most
MAX_EXTRA of the work, writes [.., W4] instead: its right padding grows until the window yields W4 columns. The
value the model had becomes a Slice view [.., :W] of it (tile_remap: offset 0, strides only, read in place), so
every reader outside the wider region reads exactly what it read before. The wider value then flows on, still
W4 wide, through
  - elementwise ops in SAFE_ELEMENTWISE (finite in, finite out and a finite derivative; BatchNormalization in
    inference mode), whose other inputs are scalars, broadcast along the width or widened alike;
  - a Conv with no right padding (a 1x1, or any window the real columns never push past W): its real outputs
    read only real columns, its extra ones the extra ones;
  - a Conv with right padding reads it times a constant mask of the real columns (a Mul that joins its
    producer's kernel), so its real outputs read zeros past W as before. (Reading the Slice view instead would
    be correct too, but the Slice's gradient, a Pad, then splits the backward's elementwise chain: a launch
    and a map more per such conv.)
An adapter's rank-r projection q = P x (memory_floor's, tagged keys.ADAPTER_SITE_Q) is not widened: it reads
x's Slice view and keeps the model's width, and the conv of U after it, reading a value as the model has it, takes
right padding like any Conv above and writes the wide delta its site adds. q is what the backward saves (MemFLoRA's
floor: r x H x W x B values, not W rounded up) and what memflora-sg finds by its tag (a widened q was a new value
without it: those sites' P stopped training); a rank-r output is a small share of the site's work.
The extra columns hold finite numbers nobody reads as output: every step output, loss and non-widened reader
sees the Slice. Their gradients are exactly zero (a Slice's gradient is a Pad with zeros, the mask's a Mul by
it, and each op on the way back multiplies by a finite derivative), so weight and bias gradients sum nothing
from them.
Why: a texel holds 4 consecutive elements of the last axis. At a width of 15 or 30 a row starts at a texel only
every 4th row, so a 1x1 conv reading 4 consecutive positions takes two fetches of partial texels and a depthwise
window three fetches per two windows (MobileNetV2 at [8,3,97,60]: planes 49 x 30 and 25 x 15). At 16 and 32 every
row is whole texels; the extra columns cost 1/15 more arithmetic there.
Runs before build_gradients, so the backward is derived from the widened Convs, Pads and Slices and comes out
wide too. Preconditions: static shapes, topologically sorted graph. In place; `modified` when a Conv was widened.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter
from fblc.compiler.shape_rules import infer_node
from fblc.compiler.values import attr, static_shape
from fblc.passes.contracts import ContractPass

LANES = 4  # elements per texel
#: the most extra columns, as a share of the real ones, worth whole-texel rows (15 -> 16, 30 -> 32 and 25 -> 28
#: pass; 7 -> 8 or 5 -> 8 would add a seventh or more of the work for rows of one or two texels)
MAX_EXTRA = 1 / 8
#: ops applied element by element that are finite with a finite derivative at any finite input, so extra
#: columns stay finite and their zero gradients stay zero (Div, Log, Sqrt, Exp, Pow could make inf or NaN there)
SAFE_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Neg", "Relu", "Clip", "LeakyRelu", "Sigmoid", "Tanh",
                              "HardSigmoid", "HardSwish", "BatchNormalization"})

Wide = dict[int, tuple[ir.Value, int]]  # id(value as the model had it) -> (its widened value, real width)


def _aligned(width: int) -> int:
    return -(-width // LANES) * LANES


def _worth_widening(width: int) -> bool:
    return width % LANES != 0 and (_aligned(width) - width) <= MAX_EXTRA * width


def _conv_window(node: ir.Node) -> tuple[int, int, int, int, int] | None:
    """(kernel extent incl. dilation, stride, begin pad, end pad, spatial rank) of a Conv's last axis, or None
    where its padding is implicit (auto_pad SAME_*) or it is not a plain Conv with static shapes."""
    if node.op_type != "Conv" or node.domain != "" or len(node.outputs) != 1 or None in node.inputs[:2]:
        return None
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad not in ("NOTSET", "VALID"):
        return None
    w_shape = static_shape(node.inputs[1])
    spatial = len(w_shape) - 2
    if spatial < 1:
        return None
    kernel = list(attr(node, "kernel_shape", None) or w_shape[2:])
    strides = list(attr(node, "strides", None) or [1] * spatial)
    dilations = list(attr(node, "dilations", None) or [1] * spatial)
    pads = list(attr(node, "pads", None) or [0] * 2 * spatial)
    return (kernel[-1] - 1) * dilations[-1] + 1, strides[-1], pads[spatial - 1], pads[-1], spatial


def _columns(width: int, extent: int, stride: int, begin: int, end: int) -> int:
    return (width + begin + end - extent) // stride + 1


def _end_pad(width: int, extent: int, stride: int, begin: int, target: int) -> int | None:
    """The right padding that makes the window over `width` columns give `target` columns (None: none can)."""
    end = max(0, (target - 1) * stride + extent - width - begin)
    return end if _columns(width, extent, stride, begin, end) == target else None


def _rebuilt(graph: ir.Graph, node: ir.Node, inputs: list[ir.Value | None], attributes: list[ir.Attr],
             width: int | None = None) -> ir.Value:
    """`node` again, before it, reading `inputs` with `attributes`: its one output, `width` wide (an elementwise
    op's), else of the shape its rule infers (a Conv's)."""
    old = node.outputs[0]
    output = ir.Value(name=f"{old.name}/wide", type=old.type)
    namer = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "forward"))
    namer.prefix = node.name or node.op_type  # a node may have no name: the Emitter's number keeps names unique
    wide = ir.Node(node.domain, node.op_type, inputs, attributes, outputs=[output], name=namer.fresh_name("wide"))
    wide.metadata_props.update(node.metadata_props)
    graph.insert_before(node, wide)
    if width is None:
        infer_node(wide)
    else:
        output.shape = ir.Shape([*static_shape(old)[:-1], width])
    return output


def _replace_by_view(graph: ir.Graph, node: ir.Node, wide_value: ir.Value, width: int, wide: Wide) -> None:
    """`node`'s output becomes the Slice [.., :width] of `wide_value`, under its own name; `node` goes."""
    e = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "forward"))
    e.anchor, e.prefix = node, f"{node.name}/aligned"
    rank = len(static_shape(wide_value))
    real = e.op("Slice", wide_value, e.ints([0]), e.ints([width]), e.ints([rank - 1]))
    old = node.outputs[0]
    name = old.name
    old.replace_all_uses_with(real, replace_graph_outputs=True)
    old.name, real.name = f"{name}/narrow", name
    graph.remove(node, safe=True)
    wide[id(real)] = (wide_value, width)


def _masked(graph: ir.Graph, before: ir.Node, real: ir.Value, wide: Wide, masks: Wide) -> ir.Value:
    """The wide value of `real` with its extra columns zero (Mul by a constant [1 .. 1 0 ..] along the width,
    which joins its producer's kernel): what a Conv that pads on the right reads, its zeros where they were."""
    if id(real) not in masks:
        wide_value, width = wide[id(real)]
        e = Emitter(graph, stage=before.metadata_props.get(keys.STAGE, "forward"))
        e.anchor, e.prefix = before, f"{real.name}/aligned"
        columns = np.arange(static_shape(wide_value)[-1]) < width
        masks[id(real)] = (e.op("Mul", wide_value, e.const(columns.astype(np.float32), dtype=wide_value.dtype)),
                           width)
    return masks[id(real)][0]


def _widen_conv(graph: ir.Graph, node: ir.Node, wide: Wide, masks: Wide) -> bool:
    window = _conv_window(node)
    if window is None or keys.ADAPTER_SITE_Q in node.outputs[0].metadata_props:
        return False  # an adapter's q = P x stays as the model has it (the module docstring says why)
    extent, stride, begin, end, spatial = window
    x = node.inputs[0]
    assert x is not None
    out_width = static_shape(node.outputs[0])[-1]
    target = _aligned(out_width) if _worth_widening(out_width) else out_width
    source: ir.Value = x
    new_end = None
    if id(x) in wide:  # read the wide input: the real outputs' windows end inside the real columns, or else
        new_end = _end_pad(static_shape(wide[id(x)][0])[-1], extent, stride, begin, target)  # in its zeroed ones
        if new_end is not None:
            source = wide[id(x)][0] if end == 0 else _masked(graph, node, x, wide, masks)
    if new_end is None:  # the wide input's columns overshoot the target, or x is as the model has it
        new_end = _end_pad(static_shape(x)[-1], extent, stride, begin, target)
    if new_end is None or (source is x and target == out_width):
        return False
    pads = list(attr(node, "pads", None) or [0] * 2 * spatial)
    pads[-1] = new_end
    attributes = [a for name, a in node.attributes.items() if name not in ("pads", "auto_pad")]
    attributes.append(ir.AttrInt64s("pads", pads))
    wide_value = _rebuilt(graph, node, [source, *node.inputs[1:]], attributes)
    if target == out_width:  # only its input widened: the output is the model's value itself
        node.outputs[0].replace_all_uses_with(wide_value, replace_graph_outputs=True)
        name = node.outputs[0].name
        node.outputs[0].name, wide_value.name = f"{name}/narrow", name
        graph.remove(node, safe=True)
        return True
    _replace_by_view(graph, node, wide_value, out_width, wide)
    return True


def _widen_elementwise(graph: ir.Graph, node: ir.Node, wide: Wide) -> bool:
    if node.op_type not in SAFE_ELEMENTWISE or node.domain != "" or len(node.outputs) != 1:
        return False
    if node.op_type == "BatchNormalization" and attr(node, "training_mode", 0):
        return False
    widths = {wide[id(v)][1] for v in node.inputs if v is not None and id(v) in wide}
    if len(widths) != 1:
        return False
    width = widths.pop()
    out_shape = static_shape(node.outputs[0])
    if not out_shape or out_shape[-1] != width:
        return False
    inputs: list[ir.Value | None] = []
    wide_width = 0
    for value in node.inputs:
        if value is not None and id(value) in wide:
            inputs.append(wide[id(value)][0])
            wide_width = static_shape(inputs[-1])[-1]
            continue
        shape = static_shape(value) if value is not None else ()
        if node.op_type != "BatchNormalization" and shape and shape[-1] != 1:
            return False  # an input along the width as the model has it: the op stays narrow and reads the Slice
        inputs.append(value)
    wide_value = _rebuilt(graph, node, inputs, list(node.attributes.values()), wide_width)
    _replace_by_view(graph, node, wide_value, width, wide)
    return True


def _drop_unread_views(graph: ir.Graph, views: list[ir.Value]) -> None:
    outputs = {id(v) for v in graph.outputs}
    for view in views:
        if not view.uses() and id(view) not in outputs:
            producer = view.producer()
            assert producer is not None
            graph.remove(producer, safe=True)


class AlignWidths(ContractPass):
    """Widen Convs (and the safe elementwise ops after them) to whole-texel rows; the model's values are views."""

    name = "align_widths"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        wide: Wide = {}
        masks: Wide = {}  # id(value as the model had it) -> (its wide value with the extra columns zero, width)
        for node in list(graph):
            if node.op_type == "Conv":
                _widen_conv(graph, node, wide, masks)
            elif any(v is not None and id(v) in wide for v in node.inputs):
                _widen_elementwise(graph, node, wide)
        _drop_unread_views(graph, [v for node in list(graph) for v in node.outputs if id(v) in wide])
        return ir.passes.PassResult(model, bool(wide))
