"""Normalisation kernels: LayerNormalization, InstanceNormalization.

A lane needs statistics of its whole row (mean and variance). Computed per lane, that is a
pass over the row for every element: O(T^2) reads for a row of T. So:

- in a training step (Mean and InvStdDev are outputs: the backward reads them), a statistics
  kernel launched first computes them, one lane per row (a work-group per texel of rows when a
  row is longer than the profile's serial limit), and the Y kernel reads them back; the
  statistics have one element per row while Y has one per element, so they cannot share a
  kernel (the builder writes outputs of one shape);
- without those outputs, where the normalised axes are a row of whole texels (a multiple of 4
  long), the Y kernel computes them once per work-item, in the builder's per-texel prologue,
  over several texels of one row; otherwise per lane.

A row of at most ROW_CACHE texels is read once, into private memory, and the second pass
reads the copy (ROW_CACHE keeps it within PRIVATE_FLOATS). Softmax and LogSoftmax have no
kernel here: split_softmax makes them a ReduceLogSumExp (reduce.py) and an elementwise map.

InstanceNormalization is LayerNormalization over the spatial axes (axis 2) with a per-channel
scale and bias, and never has statistic outputs: its Y kernel computes them itself.

All statistics accumulate in float whatever the storage type (`read_imagef` returns float).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx_ir as ir

from fblc.codegen.builder import OUT_INDEX, TEXEL_INDEX, KernelBuilder
from fblc.codegen.cl import Kernel, broadcast_index, flat_index, float_literal, strides_of
from fblc.codegen.kernels import KernelGroup, register_kernel
from fblc.codegen.textures import Texture, TextureTable
from fblc.errors import UnsupportedOpError
from fblc.compiler.index_map import map_of
from fblc.compiler.values import attr, numel, static_shape
from fblc.profiles.profile import PRIVATE_FLOATS

FAMILY = "normalization"
ROW_CACHE = PRIVATE_FLOATS // 4  # texels of a row a work-item keeps in private memory
ITEM_TEXELS = 64  # most texels of one row a work-item computes


def _flat(shape: tuple[int, ...], prefix: str, zero: Sequence[int] = ()) -> str:
    """Flat index of the multi-index `prefix0, prefix1..` with the coordinates on `zero` set to 0."""
    strides = strides_of(shape)
    return flat_index([(f"{prefix}{k}", strides[k]) for k in range(len(shape)) if k not in zero])


def _item_texels(texels: int) -> int:
    """Texels of one row a work-item computes: all of them, or the largest divisor up to ITEM_TEXELS."""
    return max(d for d in range(1, min(texels, ITEM_TEXELS) + 1) if texels % d == 0)


class Code:
    """Lines appended to a kernel body (per-texel prologue or lane loop) with C block nesting
    (transition: until this module builds IR)."""

    def __init__(self, lines: list, depth: int = 0) -> None:
        self.lines = lines
        self.depth = depth

    def emit(self, *lines: object) -> None:
        self.lines.extend("  " * self.depth + line if isinstance(line, str) else line for line in lines)

    def open(self, header: str) -> None:
        self.emit(header + " {")
        self.depth += 1

    def close(self) -> None:
        self.depth -= 1
        self.emit("}")


@dataclass
class _Row:
    """Texels k = 0..count-1 of `x` from flat element `first`, read whole: one row of 4 * count elements.

    The first pass over a row of at most ROW_CACHE texels copies it into the private array
    `cache`; the later passes read the copy. A strided view (no raw texture of its own) is read
    as four elements per texel.
    """

    b: KernelBuilder
    code: Code
    x: ir.Value
    first: str  # C int expression, a multiple of 4
    count: int
    cache: str | None = None
    _texture: tuple[str, Texture] | None = field(default=None, init=False)  # (argument, texture) for raw reads
    _filled: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.count <= ROW_CACHE:
            self.cache = self.b.fresh("row")
        if map_of(self.x).contiguous:  # a strided view is read element by element, through its map
            self._texture = self.b.argument(self.x)

    def read(self, k: str) -> str:
        """float4 C expression: texel `k` (a C int expression) read from the tensor."""
        if self._texture is not None:
            arg, texture = self._texture
            return self.b.read_texel(arg, texture, f"(({self.first}) >> 2) + ({k})")
        index = f"({self.first}) + 4 * ({k})"
        return f"(float4)({', '.join(self.b.load(self.x, f'{index} + {j}') for j in range(4))})"

    def texel(self, k: str) -> str:
        """Texel `k` as the latest pass left it: the private copy once made."""
        return f"{self.cache}[{k}]" if self._filled else self.read(k)

    def loop(self, body: Callable[[str, str], list[str]]) -> None:
        """for each texel k: `body(texel, k)`; the first pass makes the private copy."""
        k, v = self.b.fresh("k"), self.b.fresh("x")
        copy = self.cache is not None and not self._filled
        if copy:
            self.code.emit(f"float4 {self.cache}[{self.count}];")
        self.code.open(f"for (int {k} = 0; {k} < {self.count}; ++{k})")
        self.code.emit(f"const float4 {v} = {self.read(k) if copy else self.texel(k)};")
        if copy:
            self.code.emit(f"{self.cache}[{k}] = {v};")
        self.code.emit(*body(v, k))
        self.code.close()
        self._filled = self._filled or copy


# LayerNormalization --------------------------------------------------------------------------------

def _layer_norm_geometry(node: ir.Node) -> tuple[tuple[int, ...], int, int]:
    """(input shape, first normalised axis, elements per normalised row); InstanceNormalization
    normalises every [n, c] plane, the axes from 2 on."""
    shape = static_shape(node.inputs[0])
    if node.op_type == "InstanceNormalization":
        if len(shape) < 3:
            raise UnsupportedOpError(f"InstanceNormalization of a rank-{len(shape)} input (node '{node.name}') has "
                                     "no kernel", "give it an input [N, C, spatial...]")
        axis = 2
    else:
        axis = int(attr(node, "axis", -1)) % len(shape)
    return shape, axis, numel(shape[axis:])


def _row_statistics(b: KernelBuilder, code: Code, node: ir.Node, row_start: str) -> tuple[str, str]:
    """Mean and 1/sqrt(var + eps) of the contiguous row starting at flat index `row_start`,
    emitted into `code` (the lane loop or the per-texel prologue).

    Two passes (mean, then centred squares) rather than E[x^2] - E[x]^2, which cancels badly
    when the mean is large next to the spread. A row of whole texels (its length a multiple of
    4, so its start is one too) is read four elements per read.
    """
    x = node.inputs[0]
    _, _, count = _layer_norm_geometry(node)
    epsilon = float_literal(float(attr(node, "epsilon", 1e-5)))
    n = float_literal(float(count))
    total, centred, mean, inv_std = b.fresh("sum"), b.fresh("sq"), b.fresh("mean"), b.fresh("inv")
    if count % 4 == 0:
        row = _Row(b, code, x, row_start, count // 4)
        code.emit(f"float4 {total} = (float4)(0.0f);")
        row.loop(lambda v, k: [f"{total} += {v};"])
        code.emit(f"const float {mean} = ({total}.x + {total}.y + {total}.z + {total}.w) / {n};",
                  f"float4 {centred} = (float4)(0.0f);")
        row.loop(lambda v, k: [f"{centred} += ({v} - {mean}) * ({v} - {mean});"])
        code.emit(f"const float {inv_std} = rsqrt(({centred}.x + {centred}.y + {centred}.z + {centred}.w) / {n}"
                  f" + {epsilon});")
        return mean, inv_std
    r = b.fresh("r")
    code.emit(f"float {total} = 0.0f;",
              f"for (int {r} = 0; {r} < {count}; ++{r}) {total} += {b.load(x, f'{row_start} + {r}')};",
              f"const float {mean} = {total} / {n};",
              f"float {centred} = 0.0f;",
              f"for (int {r} = 0; {r} < {count}; ++{r}) {{",
              f"  const float d = {b.load(x, f'{row_start} + {r}')} - {mean};",
              f"  {centred} += d * d;",
              "}",
              f"const float {inv_std} = rsqrt({centred} / {n} + {epsilon});")
    return mean, inv_std


def _has_statistics(node: ir.Node) -> bool:
    return len(node.outputs) >= 3 and all(o is not None and o.name for o in node.outputs[1:3])


def _group_statistics(b: KernelBuilder, node: ir.Node, row_start: str) -> tuple[str, str]:
    """`_row_statistics` shared by the work-group (`b.group_size`): each work-item folds every
    group_size-th element of the row, then the group merges the sums (mean first, then the
    centred squares) in __local memory."""
    x = node.inputs[0]
    _, _, count = _layer_norm_geometry(node)
    epsilon = float_literal(float(attr(node, "epsilon", 1e-5)))
    n = float_literal(float(count))
    total, centred, mean, inv_std, r = (b.fresh(h) for h in ("sum", "sq", "mean", "inv", "r"))
    loop = f"for (int {r} = lid; {r} < {count}; {r} += {b.group_size})"
    b.emit(f"float {total} = 0.0f;", f"{loop} {total} += {b.load(x, f'{row_start} + {r}')};")
    b.merge_across_group(total)
    b.emit(f"const float {mean} = {total} / {n};", f"float {centred} = 0.0f;",
           f"{loop} {{", f"  const float d = {b.load(x, f'{row_start} + {r}')} - {mean};",
           f"  {centred} += d * d;", "}")
    b.merge_across_group(centred)
    b.emit(f"const float {inv_std} = rsqrt({centred} / {n} + {epsilon});")
    return mean, inv_std


def _statistics_kernel(table: TextureTable, name: str, node: ir.Node, outputs: list[ir.Value]) -> Kernel:
    """Mean and/or InvStdDev (shape: the input's with the normalised axes as 1), one lane per row,
    or one work-group per texel of rows when a row is longer than the serial limit."""
    shape, axis, count = _layer_norm_geometry(node)
    b = KernelBuilder(table, name, FAMILY, outputs)
    b.nodes.append(node.name)
    b.take_group()  # kernels/schedules.py: a work-group per row for a long row
    row_start = b.temp("int", _flat(shape, OUT_INDEX, range(axis, len(shape))), "row")
    if b.group_size is not None:
        mean, inv_std = _group_statistics(b, node, row_start)
    else:
        mean, inv_std = _row_statistics(b, Code(b.lines), node, row_start)
    return b.finish([mean if out is node.outputs[1] else inv_std for out in outputs])


@register_kernel("LayerNormalization", "InstanceNormalization")
def emit_layer_norm(table: TextureTable, group: KernelGroup) -> list[Kernel]:
    """Y = (X - mean) * inv_std * Scale + B over the trailing axes from `axis` (from 2, Scale and B
    per channel, for InstanceNormalization)."""
    node = group.anchor
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    shape, axis, count = _layer_norm_geometry(node)
    kernels: list[Kernel] = []
    statistics = _has_statistics(node)
    if statistics:
        # Both are written (even one nothing reads) so that the Y kernel can read them back.
        kernels.append(_statistics_kernel(table, f"{group.name}_stats", node, list(node.outputs[1:3])))
    y = node.outputs[0]
    if y not in group.outputs:
        return kernels
    b = KernelBuilder(table, group.name, FAMILY, [y])
    b.nodes.append(node.name)
    trailing = range(axis, len(shape))
    if statistics:
        stat_shape = static_shape(node.outputs[1])
        stat_index = broadcast_index(stat_shape, shape, OUT_INDEX)
        mean = b.temp("float", b.load(node.outputs[1], stat_index), "mean")
        inv_std = b.temp("float", b.load(node.outputs[2], stat_index), "inv")
    elif count % 4 == 0:
        # once per work-item, over the texels of one row it computes (kernels/schedules.py: _item_texels)
        mean, inv_std = _row_statistics(b, Code(b.texel_lines), node, _flat(shape, TEXEL_INDEX, trailing))
    else:
        row_start = b.temp("int", _flat(shape, OUT_INDEX, trailing), "row")
        mean, inv_std = _row_statistics(b, Code(b.lines), node, row_start)
    own = b.load(x, _flat(shape, OUT_INDEX))

    def affine(v: ir.Value) -> str:
        """Scale or B at the current element: per channel, or broadcast over the normalised axes."""
        if node.op_type == "InstanceNormalization":
            return b.load(v, f"{OUT_INDEX}1")
        return b.load(v, broadcast_index(static_shape(v), shape, OUT_INDEX))

    result = f"(({own} - {mean}) * {inv_std} * {affine(scale)}"
    if bias is not None:
        result += f" + {affine(bias)}"
    return kernels + [b.finish([result + ")"])]
