"""KernelBuilder: what every kernel emitter writes through.

It names texture arguments, turns reads of values into `ldf`/`ldi` calls or literals
(single-element constants are inlined), collects the per-lane body and wraps it into the
per-element kernel skeleton of `cl.py`.

A kernel may also have a per-texel prologue (`emit_texel`): code run once per work-item,
before the lane loop, that sees the multi-index of the texel's first element as `u0, u1..`
(TEXEL_INDEX). Contractions use it to compute all four lanes' reductions together, sharing
the reads the lanes have in common, and leave only their epilogue to the lane loop. With
`texels_per_item` > 1 a work-item covers that many consecutive texels: the prologue computes
all their elements (indexed by `item_lane` in the lane loop) and each texel is then written
as usual. With `item_stride` s > 1 those texels are s apart (the same texel column of
consecutive rows of s texels): a work-item then holds a 2-D tile of the output.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.codegen.cl import Kernel, broadcast_index, flat_index, index_vars, literal
from fblc.codegen.textures import Texture, TextureTable
from fblc.compiler.index_map import IndexMap, map_of, row_major_strides, view_root
from fblc.compiler.values import const_array, is_float, static_shape

OUT_INDEX = "o"  # prefix of the output multi-index variables
TEXEL_INDEX = "u"  # prefix of the multi-index of a texel's first element, seen by the per-texel prologue


def ctype_of(value: ir.Value) -> str:
    return "float" if is_float(value) else "int"


class KernelBuilder:
    """Builds one per-element kernel writing `outputs` (all of one shape)."""

    def __init__(self, table: TextureTable, name: str, family: str, outputs: Sequence[ir.Value]) -> None:
        self.table = table
        self.name = name
        self.family = family
        self.outputs = list(outputs)
        self.out_shape = static_shape(self.outputs[0])
        self.out_textures = [table.of(v) for v in self.outputs]
        self.in_textures: list[Texture] = []
        self.lines: list[str] = []
        self.texel_lines: list[str] = []  # the per-texel prologue, before the lane loop
        self.texels_per_item = 1  # texels a work-item computes (its prologue covers them all)
        self.item_stride = 1  # texels between a work-item's consecutive texels
        self.nodes: list[str] = []
        self._counter = 0

    # reading ---------------------------------------------------------------------------------
    def constant_scalar(self, value: ir.Value) -> str | None:
        """A literal for a one-element constant; parameters and state (graph inputs) are never inlined."""
        if value.is_graph_input():
            return None
        array = const_array(value)
        if array is not None and array.size == 1:
            return literal(np.asarray(array).reshape(-1)[0].item(), ctype_of(value))
        return None

    def argument(self, value: ir.Value) -> tuple[str, Texture]:
        """The texture argument holding `value`, for reads by raw texel position (a plain reading only)."""
        if not map_of(value).contiguous:
            raise AssertionError(f"'{value.name}' is a strided view: read it through load() or strided()")
        return self._argument(value)

    def _argument(self, value: ir.Value) -> tuple[str, Texture]:
        texture = self.table.of(value)
        if texture not in self.in_textures:
            self.in_textures.append(texture)
        return f"in{self.in_textures.index(texture)}", texture

    def strided(self, value: ir.Value) -> tuple[ir.Value, IndexMap]:
        """The tensor that stores `value` and how `value` reads it (a remapped view reads its root)."""
        return view_root(value), map_of(value)

    def load(self, value: ir.Value, index: str) -> str:
        """C expression: element `index` (flat in `value`'s own shape, C expression) of `value`."""
        inlined = self.constant_scalar(value)
        if inlined is not None:
            return inlined
        index_map = map_of(value)
        if not index_map.contiguous:  # a strided view: unflatten, then apply the root strides
            index = flat_index([(f"(({index}) / {inner} % {dim})" if inner > 1 else f"(({index}) % {dim})", stride)
                                for dim, inner, stride in zip(index_map.shape, row_major_strides(index_map.shape),
                                                              index_map.strides) if dim != 1], index_map.offset)
        arg, texture = self._argument(value)
        if texture.format == "r_mask4":
            return f"ldm({arg}, {index}, {texture.coord(f'({index}) >> 2')})"
        if texture.layout.kind == "flat":
            loader = "ldf" if texture.kind == "float" else "ldi"
            return f"{loader}({arg}, {index}, {texture.width})"
        lane = "lane_f" if texture.kind == "float" else "lane_i"
        return f"{lane}({self.read_texel(arg, texture, f'({index}) >> 2')}, ({index}) & 3)"

    @staticmethod
    def read_texel(arg: str, texture: Texture, texel: str) -> str:
        """C expression: the whole texel `texel` (a C int expression) of argument `arg`. Every read of a
        texture goes through RDF/RDI, which trace builds record (fblc.runtime.trace)."""
        return f"{'RDF' if texture.kind == 'float' else 'RDI'}({arg}, {texture.coord(texel)})"

    def load_broadcast(self, value: ir.Value, out_shape: Sequence[int], prefix: str = OUT_INDEX) -> str:
        """C expression: `value` numpy-broadcast to `out_shape`, at the multi-index `prefix0, prefix1..`."""
        inlined = self.constant_scalar(value)
        if inlined is not None:
            return inlined
        root, index_map = self.strided(value)
        return self.load(root, broadcast_index(index_map.shape, out_shape, prefix, index_map.strides,
                                               index_map.offset))

    # writing the body ------------------------------------------------------------------------
    def emit(self, *lines: str) -> None:
        self.lines.extend(lines)

    def emit_texel(self, *lines: str) -> None:
        """Append to the per-texel prologue (run once per work-item, before the lane loop)."""
        self.texel_lines.extend(lines)

    def temp(self, ctype: str, expression: str, hint: str = "v") -> str:
        self._counter += 1
        name = f"{hint}{self._counter}"
        self.lines.append(f"const {ctype} {name} = {expression};")
        return name

    def fresh(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}{self._counter}"

    @property
    def _first_texel(self) -> str:
        per, stride = self.texels_per_item, self.item_stride
        if stride == 1:
            return f"g * {per}"
        return f"(g / {stride}) * {per * stride} + g % {stride}"

    @property
    def item_first(self) -> str:
        """C expression, in the per-texel prologue: the flat index of the work-item's first element."""
        return "t * 4" if self.texels_per_item == 1 else f"({self._first_texel}) * 4"

    @property
    def item_lane(self) -> str:
        """C expression, in the lane loop: the lane's index among the work-item's 4 * texels_per_item outputs."""
        return "lane" if self.texels_per_item == 1 else "(tt * 4 + lane)"

    def finish(self, results: Sequence[str]) -> Kernel:
        """The kernel whose lane computes `results[k]` for output k."""
        out_numel = self.out_textures[0].numel
        texels = self.out_textures[0].texels
        per_item = self.texels_per_item
        assert texels % (per_item * self.item_stride) == 0, f"{texels} texels in items of {per_item}x{self.item_stride}"
        params = [f"write_only image2d_t out{k}" for k in range(len(self.outputs))]
        params += [f"read_only image2d_t in{k}" for k in range(len(self.in_textures))]
        body = [f"__kernel void {self.name}({', '.join(params)} TRACE_PARAM) {{", "  TRACE_INIT"]
        if per_item == 1:
            body += ["  const int t = get_global_id(0);", f"  if (t >= {texels}) return;"]
            if self.texel_lines:
                body += [f"  {line}" for line in index_vars(self.out_shape, self.item_first, TEXEL_INDEX)]
                body += [f"  {line}" for line in self.texel_lines]
            body += self._texel(out_numel, results, "  ")
        else:  # the prologue covers `per_item` texels, then each gets its lane loop and write
            body += ["  const int g = get_global_id(0);", f"  if (g >= {texels // per_item}) return;"]
            body += [f"  {line}" for line in index_vars(self.out_shape, self.item_first, TEXEL_INDEX)]
            body += [f"  {line}" for line in self.texel_lines]
            step = "tt" if self.item_stride == 1 else f"tt * {self.item_stride}"
            body += [f"  for (int tt = 0; tt < {per_item}; ++tt) {{", f"    const int t = {self._first_texel} + {step};"]
            body += self._texel(out_numel, results, "    ")
            body.append("  }")
        body.append("}")
        return Kernel(self.name, self.family, "\n".join(body), texels // per_item,
                      outputs=[t.id for t in self.out_textures], inputs=[t.id for t in self.in_textures],
                      nodes=list(self.nodes))

    def _texel(self, out_numel: int, results: Sequence[str], indent: str) -> list[str]:
        """Texel t: the lane loop computing `results` and the writes of every output."""
        body = []
        for k, texture in enumerate(self.out_textures):
            ctype = "float" if texture.kind == "float" else "int"
            body.append(f"{ctype} r{k}[4] = {{0, 0, 0, 0}};")
        body += ["for (int lane = 0; lane < 4; ++lane) {",
                 "  const int i = t * 4 + lane;",
                 f"  if (i >= {out_numel}) break;"]
        body += [f"  {line}" for line in index_vars(self.out_shape, "i", OUT_INDEX)]
        body += [f"  {line}" for line in self.lines]
        body += [f"  r{k}[lane] = {expression};" for k, expression in enumerate(results)]
        body.append("}")
        for k, texture in enumerate(self.out_textures):
            if texture.format == "r_mask4":  # the texel's 4 booleans as the low bits of one byte
                bits = " | ".join(f"((r{k}[{lane}] != 0) << {lane})" for lane in range(4))
                body.append(f"write_imageui(out{k}, {texture.coord('t')}, (uint4)({bits}, 0, 0, 0));")
            elif texture.kind == "float":
                body.append(f"write_imagef(out{k}, {texture.coord('t')}, (float4)(r{k}[0], r{k}[1], r{k}[2], r{k}[3]));")
            else:
                body.append(f"write_imagei(out{k}, {texture.coord('t')}, (int4)(r{k}[0], r{k}[1], r{k}[2], r{k}[3]));")
        return [indent + line for line in body]
