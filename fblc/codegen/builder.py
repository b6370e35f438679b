"""KernelBuilder: what every kernel emitter writes through.

Its reads of values (texture arguments, texel reads through RDF/RDI, inlined one-element
constants) are ValueReads' (`reads.py`); it collects the per-lane body and wraps it into the
per-element kernel skeleton: arguments declared through IMAGE_OUT / IMAGE_IN with their format's
texel type and written through WRF / WRI / WRU (`cl.py`'s preamble: image2d_t, or buffers under
FBLC_BUFFERS).

A kernel may also have a per-texel prologue (`emit_texel`): code run once per work-item,
before the lane loop, that sees the multi-index of the texel's first element as `u0, u1..`
(TEXEL_INDEX). Contractions use it to compute all four lanes' reductions together, sharing
the reads the lanes have in common, and leave only their epilogue to the lane loop. With
`texels_per_item` > 1 a work-item covers that many consecutive texels: the prologue computes
all their elements (indexed by `item_lane` in the lane loop) and each texel is then written
as usual. With `item_stride` s > 1 a work-item holds a 2-D tile of the output: rows s texels
apart, each of `item_columns` consecutive texels.

An r_mask8 output (a saved mask, 8 elements a byte) takes two texels per byte, and an image
write stores a whole byte, so the work-item that writes byte b must compute both its texels,
2b and 2b + 1: it ORs their nibbles and writes the byte after the odd one. A work-item whose
texels pair up among themselves (an even count of consecutive texels from an even one, or a
2-D tile whose rows are an even number of texels, an even number apart) writes them as they
come; one of an odd count (one texel, or a conv's 5 or 3 in a row) runs two consecutive items
in turn (`PAIR`). A 2-D tile of odd columns cannot: its schedule stores the mask as r_mask4
(codegen/schedule.py, decided before any texture exists).

The tile, like the work-group a long reduction takes, is the kernel's `Schedule`, which
kernels/schedules.py decided before the kernel is built (TextureTable.schedules, by kernel name);
`finish` records what the kernel used into it (plan.json).
"""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir

from fblc.bundle_format import BUFFER_C_TYPES, MASK_FORMATS
from fblc.codegen.cl import Kernel, div_index, index_vars, mod_index
from fblc.codegen.reads import OUT_INDEX, TEXEL_FIRST, TEXEL_LAST, ValueReads, ctype_of
from fblc.codegen.schedule import Schedule, pairs_mask_bytes
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import static_shape

__all__ = ["KERNEL_NAMES", "OUT_INDEX", "TEXEL_INDEX", "KernelBuilder", "ctype_of", "lane_axis"]

TEXEL_INDEX = "u"  # prefix of the multi-index of a texel's first element, seen by the per-texel prologue
PAIR = 2  # items a work-item runs in turn when one alone holds an odd number of a mask8 output's texels

#: The names kernels declare, in one place: an emitter that needs a variable takes one of these
#: (or `fresh(hint)`, which adds a number); tests/test_kernel_names.py checks every bundle's
#: kernels.cl against this table.
KERNEL_NAMES: dict[str, str] = {
    "t": "the output texel the work-item (or, in a group kernel, the work-group) computes",
    "g": "the work-item's index when it computes several texels (texels_per_item > 1)",
    "tt": "a texel's place in the work-item's tile of texels",
    "wi": "the work-item's index when it runs PAIR items in turn (odd mask8 outputs)",
    "sub": "which of the PAIR items runs",
    "lane": "the element's lane in its texel, 0 to 3",
    "i": "the element's flat index in the output tensor",
    "lid": "the work-item's index in its work-group (group kernels)",
    "shared": "the group kernel's __local partials, one per work-item (a tile's: one per accumulator and work-item)",
    "pool": "the __local partials of a work-group that holds several tiles, a slice (`shared`) each",
    "j": "an accumulator of a work-item's tile, in a group kernel's merge of partial tiles",
    "part": "a work-item's partial in a group kernel's merge of partial tiles",
    "total": "the sum of a tile accumulator's partials in that merge",
    "s": "the stride of a group merge's tree",
    "x": "the element a reduction loop folds",
    "v": "the texel (float4) a reduction loop reads",
    "d": "an element minus its row's mean (normalisation)",
    f"{OUT_INDEX}<k>": "axis k of the output element's multi-index",
    f"{TEXEL_INDEX}<k>": "axis k of the multi-index of the work-item's first element (the per-texel prologue)",
    f"{TEXEL_FIRST}<k>": "axis k of the multi-index of the written texel's first element (its hoisted reads)",
    f"{TEXEL_LAST}<k>": "axis k of the multi-index of the written texel's last element (its hoisted reads)",
    "r<k>": "output k's four lane results of the texel",
    "byte<k>": "the byte of mask8 output k being assembled",
    "out<k>": "image argument: output k",
    "in<k>": "image argument: input k",
}


class KernelBuilder(ValueReads):
    """Builds one per-element kernel writing `outputs` (all of one shape); reads come from ValueReads."""

    def __init__(self, table: TextureTable, name: str, family: str, outputs: Sequence[ir.Value]) -> None:
        super().__init__(table, static_shape(outputs[0]))
        self.name = name
        self.family = family
        self.outputs = list(outputs)
        self.out_textures = [table.of(v) for v in self.outputs]
        self.lines: list[str] = []
        self.texel_lines: list[str] = []  # the per-texel prologue, before the lane loop
        #: per output texel, just before its lane loop: the lanes a guarded reduction leaves (reduce_guarded)
        self.lane_fallback: list[str] = []
        self.texels_per_item = 1  # texels a work-item computes (its prologue covers them all)
        self.item_stride = 1  # texels between a work-item's consecutive rows of texels
        self.item_columns = 1  # consecutive texels per row of a work-item's tile (item_stride > 1)
        self.nodes: list[str] = []
        #: work-items that cooperate on each output texel, or tile of texels (a work-group: `lid` its
        #: local id; the group's results go out from work-item 0), or None: one work-item per texel
        self.group_size: int | None = None
        self.tiles_per_group = 1  # items (tiles) a group kernel's work-group holds, group_size work-items each
        self.shared_floats = 0  # the __local floats of a group kernel, when more than one per work-item
        self.schedule = table.schedules.setdefault(name, Schedule())
        self.tile_texels(self.schedule.tile_rows, self.schedule.tile_columns, self.schedule.tile_stride)

    # writing the body ------------------------------------------------------------------------
    def emit(self, *lines: str) -> None:
        self.lines.extend(lines)

    def emit_texel(self, *lines: str) -> None:
        """Append to the per-texel prologue (run once per work-item, before the lane loop)."""
        self.texel_lines.extend(lines)

    def temp(self, ctype: str, expression: str, hint: str = "v") -> str:
        name = self.fresh(hint)
        self.lines.append(f"const {ctype} {name} = {expression};")
        return name

    def merge_across_group(self, acc: str, merge: str = "{a} + {b}", prologue: bool = False) -> None:
        """Join every work-item's partial `acc` (a float) with `merge` (a C template over `a` and
        `b`) in a tree in __local memory; afterwards every work-item of the group holds the result.
        Only in a group kernel (`group_size`), where every work-item reaches the barriers; in the
        per-texel prologue with `prologue`."""
        assert self.group_size is not None, "a merge across the group needs a group kernel"
        merged = merge.format(a="shared[lid]", b="shared[lid + s]")
        (self.emit_texel if prologue else self.emit)(f"shared[lid] = {acc};", "barrier(CLK_LOCAL_MEM_FENCE);",
                  f"for (int s = {self.group_size // 2}; s > 0; s >>= 1) {{",
                  f"  if (lid < s) shared[lid] = {merged};",
                  "  barrier(CLK_LOCAL_MEM_FENCE);",
                  "}",
                  f"{acc} = shared[0];",
                  "barrier(CLK_LOCAL_MEM_FENCE);  // shared is free again for the next merge")

    def merge_tiles_across_group(self, acc: str, lanes: int) -> list[str]:
        """Lines that sum the work-items' partial tiles `acc[lanes]` (a reduction the group dealt out)
        through __local memory: each work-item stores its partials, work-item j sums accumulator j's
        (and every group_size-th after it) in work-item order, then every work-item reads the totals."""
        group = self.group_size
        assert group is not None, "a merge across the group needs a group kernel"
        self.shared_floats = max(self.shared_floats, group * lanes)
        return [f"for (int j = 0; j < {lanes}; ++j) shared[j * {group} + lid] = {acc}[j];",
                "barrier(CLK_LOCAL_MEM_FENCE);",
                f"for (int j = lid; j < {lanes}; j += {group}) {{",
                "  float total = 0.0f;",
                f"  for (int part = 0; part < {group}; ++part) total += shared[j * {group} + part];",
                f"  shared[j * {group}] = total;",
                "}",
                "barrier(CLK_LOCAL_MEM_FENCE);",
                f"for (int j = 0; j < {lanes}; ++j) {acc}[j] = shared[j * {group}];"]

    def tile_texels(self, rows: int, columns: int, stride: int) -> None:
        """Make each work-item hold a 2-D tile: `rows` rows `stride` texels apart, each of `columns`
        consecutive texels (stride a multiple of columns; rows 1 texel apart are consecutive texels)."""
        assert stride % columns == 0, f"a tile of {columns} texel columns in rows {stride} texels apart"
        self.texels_per_item, self.item_columns, self.item_stride = rows * columns, columns, stride

    def take_group(self) -> None:
        """Share each item among the schedule's group_size work-items (a long reduction's work-group)."""
        size = self.schedule.group_size or 1
        self.group_size = size if size > 1 else None

    def _record_schedule(self) -> None:
        """Write what the kernel used into its schedule (plan.json records it)."""
        schedule, columns = self.schedule, self.item_columns
        schedule.tile_rows, schedule.tile_columns = self.texels_per_item // columns, columns
        schedule.tile_stride, schedule.tiles_per_group = self.item_stride, self.tiles_per_group
        schedule.group_size = self.group_size or 1

    @property
    def _first_texel(self) -> str:
        per, stride, columns = self.texels_per_item, self.item_stride, self.item_columns
        if stride == 1:
            return f"g * {per}"
        across = stride // columns  # tiles side by side in a band of the tile's rows
        if across == 1:
            return f"g * {per // columns * stride}"
        corner = f"{mod_index('g', across)} * {columns}" if columns > 1 else mod_index("g", across)
        return f"{div_index('g', across)} * {per // columns * stride} + {corner}"

    @property
    def _tile_step(self) -> str:
        """C expression: texel tt of the work-item's tile (row-major over rows and columns), from its first."""
        if self.item_stride == self.item_columns:  # whole rows: the tile's texels are consecutive
            return "tt"
        if self.item_columns == 1:
            return f"tt * {self.item_stride}"
        columns = self.item_columns
        return f"{div_index('tt', columns)} * {self.item_stride} + {mod_index('tt', columns)}"

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
        texels = self.out_textures[0].texels
        per_item = self.texels_per_item
        band = per_item // self.item_columns * self.item_stride  # texels in a band of the tiles' rows
        assert texels % band == 0, f"{texels} texels in bands of {band}"
        items = self.items
        masks = [t for t in self.out_textures if t.format == MASK_FORMATS["mask8"]]
        self._record_schedule()
        assert not masks or pairs_mask_bytes(self.schedule), \
            f"{self.name}: its tile splits the bytes of mask8 outputs its schedule did not store as r_mask4"
        pair = PAIR if masks and per_item % 2 else 1
        params = [f"IMAGE_OUT({BUFFER_C_TYPES[t.format]}, out{k})" for k, t in enumerate(self.out_textures)]
        params += [f"IMAGE_IN({BUFFER_C_TYPES[t.format]}, in{k})" for k, t in enumerate(self.in_textures)]
        body = [f"__kernel void {self.name}({', '.join(params)} TRACE_PARAM) {{", "  TRACE_INIT"]
        item = "t" if per_item == 1 else "g"  # the item's index: its texel, or its place among the items
        if self.group_size is not None:  # group_size work-items per item: every branch below is uniform in them
            assert pair == 1 and not masks, "group kernels write float texels"
            body += ["  " + line for line in self._group_header(item)] + [f"  if ({item} >= {items}) return;"]
        elif pair == 1:
            body += [f"  const int {item} = get_global_id(0);", f"  if ({item} >= {items}) return;"]
        else:
            body += ["  const int wi = get_global_id(0);", f"  if (wi >= {-(-items // pair)}) return;"]
        body += [f"  uint byte{k} = 0;" for k, t in enumerate(self.out_textures) if any(t is m for m in masks)]
        indent = "  "
        if pair > 1:
            body += [f"  for (int sub = 0; sub < {pair}; ++sub) {{", f"    const int {item} = wi * {pair} + sub;"]
            body += [f"    if ({item} >= {items}) break;"] if items % pair else []
            indent = "    "
        body += [indent + line for line in self._item(results)]
        body += ["  }"] if pair > 1 else []
        body.append("}")
        group = self.group_size
        return Kernel(self.name, self.family, "\n".join(body), items * group if group else -(-items // pair),
                      outputs=[t.id for t in self.out_textures], inputs=[t.id for t in self.in_textures],
                      nodes=list(self.nodes), group_size=group * self.tiles_per_group if group else None)

    @property
    def items(self) -> int:
        """The kernel's items: its output texels, or tiles of texels_per_item texels."""
        return self.out_textures[0].texels // self.texels_per_item

    def _group_header(self, item: str) -> list[str]:
        """A group kernel's item `item`, its work-item's `lid` among the item's group_size and the item's
        __local `shared` floats. With tiles_per_group > 1 the work-group's consecutive runs of group_size
        work-items hold consecutive items, each with its own slice of the group's __local `pool`, so
        the merges index `shared` alike; every work-group holds whole items (their count divides items)."""
        group, tiles = self.group_size, self.tiles_per_group
        assert group is not None and self.items % tiles == 0, f"{self.items} items in groups of {tiles}"
        floats = max(group, self.shared_floats)
        if tiles == 1:
            return [f"const int {item} = get_group_id(0);", "const int lid = get_local_id(0);",
                    f"__local float shared[{floats}];"]
        run = div_index("get_local_id(0)", group)
        return [f"const int {item} = get_group_id(0) * {tiles} + {run};",
                f"const int lid = {mod_index('get_local_id(0)', group)};",
                f"__local float pool[{tiles * floats}];",
                f"__local float* shared = pool + {run} * {floats};"]

    def _item(self, results: Sequence[str]) -> list[str]:
        """One item (t or g declared): its per-texel prologue, then each of its texels."""
        prologue = self.item_index_vars(self.out_shape, TEXEL_INDEX) + self.texel_lines
        if self.texels_per_item == 1:  # the prologue covers texel t
            return (prologue if self.texel_lines else []) + self._texel(results)
        own_first = None
        rows = self._tile_rows(self.out_shape)
        if rows is not None:  # texel tt of the tile: its row and column follow from the tile's
            columns = self.item_columns
            row = f"{rows[0]} + {div_index('tt', columns)}" if columns > 1 else f"{rows[0]} + tt"
            column = f"{rows[1]} + {mod_index('tt', columns)} * 4" if columns > 1 else rows[1]
            own_first = _row_index_vars(self.out_shape, row, column, TEXEL_FIRST)
        return prologue + [f"for (int tt = 0; tt < {self.texels_per_item}; ++tt) {{",
                           f"  const int t = {self._first_texel} + {self._tile_step};"] + \
            ["  " + line for line in self._texel(results, own_first)] + ["}"]

    def item_index_vars(self, shape: Sequence[int], prefix: str) -> list[str]:
        """Statements declaring `prefix0..` as the multi-index in `shape` (the output's, or a view of it
        in the same element order) of the work-item's first element: from the item's place in the grid
        of tiles where a tile's rows are rows of the shape's lane axis, else by dividing its flat index."""
        rows = self._tile_rows(shape)
        if rows is None:
            return index_vars(shape, self.item_first, prefix)
        return _row_index_vars(shape, *rows, prefix)

    def _tile_rows(self, shape: Sequence[int]) -> tuple[str, str] | None:
        """(flat row over the axes before the lane axis, element column in it) of the item's first
        texel, when a tile's rows are rows of `shape`'s lane axis (the contractions' tiles); else None."""
        per, stride, columns = self.texels_per_item, self.item_stride, self.item_columns
        axis = lane_axis(shape)
        if per == 1 or stride == 1 or axis is None or shape[axis] != 4 * stride:
            return None
        across = stride // columns
        if across == 1:
            return f"g * {per // columns}", "0"
        return f"{div_index('g', across)} * {per // columns}", f"{mod_index('g', across)} * {4 * columns}"

    def _texel(self, results: Sequence[str], own_first: list[str] | None = None) -> list[str]:
        """Texel t: the lane loop computing `results` and the writes of every output (`own_first`: the
        statements declaring its first element's multi-index, when cheaper than from t)."""
        out_numel, texels = self.out_textures[0].numel, self.out_textures[0].texels
        body = []
        for k, texture in enumerate(self.out_textures):
            ctype = "float" if texture.kind == "float" else "int"
            body.append(f"{ctype} r{k}[4] = {{0, 0, 0, 0}};")
        # a texel within one row of the lane axis: its lanes' indices are its first element's, plus the
        # lane along that axis (one division per axis per texel, not per lane)
        lanes = lane_axis(self.out_shape)
        in_one_row = lanes is not None
        if self.texel_reads or in_one_row:
            body += own_first or index_vars(self.out_shape, "t * 4", TEXEL_FIRST)
        if self.texel_reads:
            if self._reads_last:
                body += index_vars(self.out_shape, f"min(t * 4 + 3, {out_numel - 1})", TEXEL_LAST)
            body += self.texel_reads
        body += self.lane_fallback
        # unrolled, the loop indexes r<k> and the accumulators by constants, which stay in registers; a
        # tensor that ends inside its last texel keeps the loop and its early exit (which LLVM cannot unroll)
        tail = out_numel % 4 != 0
        body += ([] if tail else ["#pragma unroll"]) + ["for (int lane = 0; lane < 4; ++lane) {",
                                                        "  const int i = t * 4 + lane;"]
        body += [f"  if (i >= {out_numel}) break;"] if tail else []
        if in_one_row:
            body += [f"  const int {OUT_INDEX}{axis} = {TEXEL_FIRST}{axis}{' + lane' if axis == lanes else ''};"
                     for axis in range(len(self.out_shape))]
        else:
            body += [f"  {line}" for line in index_vars(self.out_shape, "i", OUT_INDEX)]
        body += [f"  {line}" for line in self.lines]
        body += [f"  r{k}[lane] = {expression};" for k, expression in enumerate(results)]
        body.append("}")
        for k, texture in enumerate(self.out_textures):
            bits = " | ".join(f"((r{k}[{lane}] != 0) << {lane})" for lane in range(4))  # lane l: bit l, LSB first
            if texture.format == MASK_FORMATS["mask8"]:  # texel t: nibble t & 1 of byte t >> 1, written after both
                last = f" || t == {texels - 1}" if texels % 2 else ""  # an odd count's last byte has one texel
                body += [f"byte{k} |= (uint)({bits}) << ((t & 1) * 4);",
                         f"if ((t & 1){last}) {{",
                         f"  WRU(out{k}, {texture.coord('t >> 1')}, (uint4)(byte{k}, 0, 0, 0));",
                         f"  byte{k} = 0;",
                         "}"]
            elif texture.format == MASK_FORMATS["mask4"]:  # the texel's 4 booleans as the low bits of byte t
                body.append(f"WRU(out{k}, {texture.coord('t')}, (uint4)({bits}, 0, 0, 0));")
            else:  # a group kernel's texel goes out from its work-item 0
                write, vector = ("WRF", "float4") if texture.kind == "float" else ("WRI", "int4")
                body.append(f"{'if (lid == 0) ' if self.group_size is not None else ''}{write}(out{k}, "
                            f"{texture.coord('t')}, ({vector})(r{k}[0], r{k}[1], r{k}[2], r{k}[3]));")
        return body


def lane_axis(shape: Sequence[int]) -> int | None:
    """The axis a texel's 4 lanes walk: the innermost non-unit one, when its length is a multiple of 4."""
    for axis in reversed(range(len(shape))):
        if shape[axis] != 1:
            return axis if shape[axis] % 4 == 0 else None
    return None


def _row_index_vars(shape: Sequence[int], row: str, column: str, prefix: str) -> list[str]:
    """`prefix0..` for the element at element column `column` of flat row `row` (C expressions) of
    `shape` seen as rows of its lane axis (the axes after it have length 1)."""
    axis = lane_axis(shape)
    assert axis is not None
    lines = index_vars(shape[:axis], f"({row})", prefix) + [f"const int {prefix}{axis} = {column};"]
    return lines + [f"const int {prefix}{k} = 0;" for k in range(axis + 1, len(shape))]
