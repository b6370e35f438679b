"""Output shapes and dtypes of the ops fblc emits, by table, computed as each node is appended.

The loss, backward and optimizer emit thousands of nodes; computing their shapes here, from
the static shapes of their inputs, spares a whole-graph shape inference after each pass
(which dominates build time on a 1B-parameter decoder). Every op the emitter may append has
a rule, named in the op table's `shape` column (fblc/compiler/ops.py); tests check the results
against onnx's own shape inference.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.ops import OPS
from fblc.compiler.registry import OpRegistry
from fblc.compiler.values import attr, const_array

Shape = tuple[int, ...]
Result = list[tuple[Shape, ir.DataType]]
ShapeRule = Callable[[ir.Node, list[Shape], list["ir.DataType"]], Result]

SHAPE_RULES: OpRegistry[ShapeRule] = OpRegistry("shape rule", "add one in fblc/compiler/shape_rules.py")
#: rule name (the op table's `shape` column, fblc/compiler/ops.py) -> the rule
NAMED_RULES: dict[str, ShapeRule] = {}


def _named(rule: ShapeRule) -> ShapeRule:
    """Decorator: `rule` under its function's name without the leading underscore."""
    NAMED_RULES[rule.__name__.lstrip("_")] = rule
    return rule


def infer_node(node: ir.Node) -> None:
    """Set the shape and dtype of `node`'s outputs from its inputs' static shapes."""
    rule = SHAPE_RULES.lookup(node)
    shapes = [tuple(v.shape) if v is not None and v.shape is not None else () for v in node.inputs]
    dtypes = [v.dtype if v is not None else None for v in node.inputs]
    for out, (shape, dtype) in zip(node.outputs, rule(node, shapes, dtypes)):
        out.shape = ir.Shape(list(shape))
        out.dtype = dtype


def _ints(node: ir.Node, index: int) -> list[int]:
    return [int(v) for v in np.asarray(const_array(node.inputs[index])).reshape(-1)]


def _broadcast(shapes: Sequence[Shape]) -> Shape:
    """numpy broadcasting of static shapes (np.broadcast_shapes is slow for thousands of calls)."""
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for shape in shapes:
        for i, dim in enumerate(shape, start=rank - len(shape)):
            if dim != 1:
                if out[i] not in (1, dim):
                    raise ValueError(f"shapes {list(shapes)} do not broadcast")
                out[i] = dim
    return tuple(out)


@_named
def _arithmetic(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(_broadcast(shapes), dtypes[0])]


@_named
def _comparison(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(_broadcast(shapes), ir.DataType.BOOL)]


@_named
def _is_nan(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(shapes[0], ir.DataType.BOOL)]


@_named
def _where(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(_broadcast(shapes), dtypes[1])]


@_named
def _same(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(shapes[0], dtypes[0])]


@_named
def _cast(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(shapes[0], ir.DataType(attr(node, "to")))]


@_named
def _dequantize(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    """The data's shape in the scale's float type (DequantizeLinear's output_dtype unset)."""
    return [(shapes[0], dtypes[1])]


@_named
def _reshape(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    target = _ints(node, 1)
    total = int(np.prod(shapes[0], dtype=np.int64))
    target = [shapes[0][i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in target:
        known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
        target[target.index(-1)] = total // known
    return [(tuple(target), dtypes[0])]


@_named
def _unsqueeze(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    rank = len(shapes[0]) + len(_ints(node, 1))
    axes = sorted(a % rank for a in _ints(node, 1))
    out = list(shapes[0])
    for axis in axes:
        out.insert(axis, 1)
    return [(tuple(out), dtypes[0])]


@_named
def _transpose(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    perm = attr(node, "perm") or list(reversed(range(len(shapes[0]))))
    return [(tuple(shapes[0][p] for p in perm), dtypes[0])]


@_named
def _reduce(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    rank = len(shapes[0])
    axes = _ints(node, 1) if len(node.inputs) > 1 and node.inputs[1] is not None else list(range(rank))
    axes = {a % rank for a in axes}
    keep = int(attr(node, "keepdims", 1))
    out = [1 if i in axes else d for i, d in enumerate(shapes[0]) if keep or i not in axes]
    return [(tuple(out), dtypes[0])]


@_named
def _arg_reduce(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    """ArgMax: the index along one axis (default 0), kept as a 1 where keepdims (default 1), int64."""
    rank = len(shapes[0])
    axis = int(attr(node, "axis", 0)) % max(rank, 1)
    keep = int(attr(node, "keepdims", 1))
    out = [1 if i == axis else d for i, d in enumerate(shapes[0]) if keep or i != axis]
    return [(tuple(out), ir.DataType.INT64)]


@_named
def _expand(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(_broadcast([shapes[0], tuple(_ints(node, 1))]), dtypes[0])]


@_named
def _constant_of_shape(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(tuple(_ints(node, 0)), ir.DataType(attr(node, "value").dtype))]


@_named
def _matmul(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    a, b = shapes
    a2 = a if len(a) >= 2 else (1,) + a
    b2 = b if len(b) >= 2 else b + (1,)
    out = _broadcast([a2[:-2], b2[:-2]]) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return [(out, dtypes[0])]


@_named
def _gemm(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    a, b = shapes[0], shapes[1]
    rows = a[1] if attr(node, "transA", 0) else a[0]
    cols = b[0] if attr(node, "transB", 0) else b[1]
    return [((rows, cols), dtypes[0])]


@_named
def _philox_normal(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    """fblc's device-only noise ops (pass es_noise): float32 of their `shape` attribute."""
    return [(tuple(int(d) for d in attr(node, "shape", [])), ir.DataType.FLOAT)]


@_named
def _merge_runs(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    """fblc's device-only sort step (passes sort_scatter_rows, sort_topk): the sorted keys and their positions
    (int64). Keys given with their positions keep their dtype (sort_topk's values); alone they are row numbers."""
    keys = dtypes[0] if len(node.inputs) > 1 and node.inputs[1] is not None else ir.DataType.INT64
    return [(shapes[0], keys), (shapes[0], ir.DataType.INT64)]


@_named
def _scatter_sorted_rows(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    """The data's shape, or without data (a zero table) its `shape` attribute; the updates' dtype."""
    if node.inputs[0] is None:
        return [(tuple(int(d) for d in attr(node, "shape", [])), dtypes[3])]
    return [(shapes[0], dtypes[0])]


@_named
def _scatter(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(shapes[0], dtypes[0])]


@_named
def _gather(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    axis = int(attr(node, "axis", 0)) % len(shapes[0])
    return [(shapes[0][:axis] + shapes[1] + shapes[0][axis + 1:], dtypes[0])]


@_named
def _gather_elements(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    return [(shapes[1], dtypes[0])]


@_named
def _gather_nd(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    """indices [.., k] pick slices of data past its batch dims and k tuple axes (the scatters' gradients)."""
    batch, indices = int(attr(node, "batch_dims", 0)), shapes[1]
    return [(indices[:-1] + shapes[0][batch + indices[-1]:], dtypes[0])]


@_named
def _pad(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    pads = _ints(node, 1)
    rank = len(shapes[0])
    return [(tuple(d + pads[i] + pads[i + rank] for i, d in enumerate(shapes[0])), dtypes[0])]


@_named
def _slice(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    rank = len(shapes[0])
    starts, ends = _ints(node, 1), _ints(node, 2)
    axes = _ints(node, 3) if len(node.inputs) > 3 and node.inputs[3] is not None else list(range(len(starts)))
    steps = _ints(node, 4) if len(node.inputs) > 4 and node.inputs[4] is not None else [1] * len(starts)
    out = list(shapes[0])
    for start, end, axis, step in zip(starts, ends, axes, steps):
        out[axis % rank] = len(range(*slice(start, end, step).indices(shapes[0][axis % rank])))
    return [(tuple(out), dtypes[0])]


@_named
def _split(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    axis = int(attr(node, "axis", 0)) % len(shapes[0])
    sizes = _ints(node, 1)
    return [(shapes[0][:axis] + (size,) + shapes[0][axis + 1:], dtypes[0]) for size in sizes]


@_named
def _concat(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    axis = int(attr(node, "axis")) % len(shapes[0])
    total = sum(s[axis] for s in shapes)
    return [(shapes[0][:axis] + (total,) + shapes[0][axis + 1:], dtypes[0])]


def _window_out(size: int, kernel: int, stride: int, dilation: int, pad_total: int) -> int:
    return (size + pad_total - dilation * (kernel - 1) - 1) // stride + 1


def _window_attrs(node: ir.Node, rank: int) -> tuple[list[int], list[int], list[int]]:
    """strides, dilations, pads of an emitted Conv/ConvTranspose (the emitter always writes pads explicitly)."""
    return (attr(node, "strides") or [1] * rank, attr(node, "dilations") or [1] * rank,
            attr(node, "pads") or [0] * (2 * rank))


@_named
def _conv(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    x, w = shapes[0], shapes[1]
    rank = len(x) - 2
    strides, dilations, pads = _window_attrs(node, rank)
    spatial = [_window_out(x[2 + i], w[2 + i], strides[i], dilations[i], pads[i] + pads[i + rank])
               for i in range(rank)]
    return [((x[0], w[0], *spatial), dtypes[0])]


@_named
def _conv_transpose(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    x, w = shapes[0], shapes[1]
    rank = len(x) - 2
    strides, dilations, pads = _window_attrs(node, rank)
    extra = attr(node, "output_padding") or [0] * rank
    spatial = [(x[2 + i] - 1) * strides[i] + (w[2 + i] - 1) * dilations[i] + 1 - pads[i] - pads[i + rank] + extra[i]
               for i in range(rank)]
    return [((x[0], w[1] * int(attr(node, "group", 1)), *spatial), dtypes[0])]


def pool_output_size(size: int, kernel: int, stride: int, dilation: int, pad_begin: int, pad_end: int,
                     ceil_mode: bool) -> int:
    """Output length of a pooling window along one axis, with explicit pads.

    With ceil_mode a last, partial window is kept, but only when it starts inside the input or
    its begin padding: one starting in the end padding would see nothing but padding. That is
    onnxruntime's and torch's rule; onnx's own shape inference (1.23) leaves the second part out,
    which is why `fblc.passes.infer_shapes` corrects ceil_mode pools with this function.
    """
    span = size + pad_begin + pad_end - dilation * (kernel - 1) - 1
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1
    if (out - 1) * stride >= size + pad_begin:
        out -= 1
    return out


@_named
def _pool(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    x = shapes[0]
    rank = len(x) - 2
    kernel = attr(node, "kernel_shape")
    strides, dilations, pads = _window_attrs(node, rank)
    auto_pad = attr(node, "auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        spatial = [-(-x[2 + i] // strides[i]) for i in range(rank)]
    else:
        if auto_pad == "VALID":
            pads = [0] * (2 * rank)
        ceil_mode = bool(attr(node, "ceil_mode", 0))
        spatial = [pool_output_size(x[2 + i], kernel[i], strides[i], dilations[i], pads[i], pads[i + rank], ceil_mode)
                   for i in range(rank)]
    out = (x[0], x[1], *spatial)
    return [(out, dtypes[0]), (out, ir.DataType.INT64)][: len(node.outputs)]


@_named
def _scan(node: ir.Node, shapes: list[Shape], dtypes: list) -> Result:
    """Scans and masks keep their input's shape and dtype (emitted by their own gradients)."""
    return [(shapes[0], dtypes[0])]


for _op_type, _entry in OPS.items():
    if _entry.shape is not None:
        SHAPE_RULES.register(_op_type)(NAMED_RULES[_entry.shape])
