"""KernelBuilder: the kernel skeleton every emitter fills (docs/ARCHITECTURE.md §3); its reads are ValueReads'.

Its per-texel prologue (`prologue`) runs once per work-item, before the lane loop, and sees the multi-index of the
texel's first element as `u0, u1..` (TEXEL_INDEX): contractions compute all four lanes' reductions there, sharing
the reads the lanes have in common. A work-item's tile (its `Schedule`; `finish` records what the kernel used) is
`texels_per_item` consecutive texels, or with `item_stride` s > 1 rows s texels apart of `item_columns` texels each.

An r_mask8 output (8 elements a byte) takes two texels per byte, and an image write stores a whole
byte, so the work-item that writes byte b computes both texels 2b and 2b + 1: it ORs their nibbles and
writes the byte after the odd one. A work-item of an odd count of texels runs two items in turn (`PAIR`);
a 2-D tile of an even number of rows P texels apart whose consecutive texels lie in two work-items writes bytes
that pair its rows 2j and 2j + 1 instead (the mask's layout says P, texel_layout; a byte accumulates per column);
a tile of an odd number of such rows stores the mask as r_mask4 (codegen/schedule.py).
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import TYPE_CHECKING, Sequence

import onnx_ir as ir

from fblc.bundle_format import MASK_FORMATS
from fblc.codegen import ir as kir
from fblc.codegen import texel_wide
from fblc.codegen.cl import Kernel
from fblc.codegen.group_merges import GroupMerges
from fblc.codegen.ir import INT, UINT, Block, Expr, Statement, Var, const, div_index, flat_index, mod_index
from fblc.codegen.indexing import declare_index, declare_row_index, lane_axis
from fblc.codegen.reads import (ITEM_FIRST, OUT_INDEX, RUN_FIRST, RUN_LAST, TEXEL_FIRST, TEXEL_LAST, ValueReads,
                                mask_position)
from fblc.codegen.schedule import Schedule, pairs_mask_bytes, pairs_rows
from fblc.codegen.textures import TextureTable
from fblc.compiler.values import static_shape

if TYPE_CHECKING:
    from fblc.codegen.kernels import KernelGroup

__all__ = ["OUT_INDEX", "TEXEL_INDEX", "KernelBuilder", "lane_axis"]

TEXEL_INDEX = ITEM_FIRST  # prefix of the multi-index of a texel's (a tile's) first element, seen by its prologue
PAIR = 2  # items a work-item runs in turn when one alone holds an odd number of a mask8 output's texels
class KernelBuilder(GroupMerges, ValueReads):
    """Builds one per-element kernel writing `outputs` (all of one shape); reads come from ValueReads."""

    def __init__(self, table: TextureTable, name: str, family: str, outputs: Sequence[ir.Value]) -> None:
        super().__init__(table, static_shape(outputs[0]))
        self.name = name
        self.family = family
        self.outputs = list(outputs)
        self.out_textures = [table.of(v) for v in self.outputs]
        self.lines: list[Statement] = []  # the lane loop's body
        self.texel_lines: list[Statement] = []  # the per-texel prologue, before the lane loop
        #: per output texel, just before its lane loop: the lanes a guarded reduction leaves (reduce_guarded)
        self.lane_fallback: list[Statement] = []
        self.nodes: list[str] = []
        #: work-items that cooperate on each output texel, or tile of texels (a work-group: `lid` its
        #: local id; the group's results go out from work-item 0), or None: one work-item per texel
        self.group_size: int | None = None
        self.tiles_per_group = 1  # items (tiles) a group kernel's work-group holds, group_size work-items each
        self.shared_floats = 0  # the __local floats of a group kernel, when more than one per work-item
        self.shared = _named("shared", kir.FLOAT)
        self._one_writer = False  # a group kernel's texels computed and written by work-item 0 alone (`_item`)
        #: work-items of a work-group that stage shared texels in __local (kernels/staging.py), each its own item,
        #: and the __local arrays they stage into (declared at the kernel's scope); None: no staging
        self.staging_group: int | None = None
        self.staging_order = (0, 0)  # its items' order (staging.grouped_item's across, period)
        self.staging_launch_order = False  # whether a storage that does not stage keeps the launch's order instead
        self.staged_arrays: list[Statement] = []
        self.schedule = table.schedules.setdefault(name, Schedule())
        # the tile: rows `item_stride` texels apart (a multiple of its columns), `item_columns` texels each
        rows, columns, stride = self.schedule.tile_rows, self.schedule.tile_columns, self.schedule.tile_stride
        assert stride % columns == 0, f"a tile of {columns} texel columns in rows {stride} texels apart"
        self.texels_per_item, self.item_columns, self.item_stride = rows * columns, columns, stride
        # consecutive texels of a tile: the whole tile where its rows are whole, else each row's columns
        self.run_texels = self.texels_per_item if stride == columns else columns

    @classmethod
    def for_group(cls, table: TextureTable, group: KernelGroup, family: str) -> KernelBuilder:
        """The builder of a kernel group's kernel: it writes the group's outputs and records the group's
        anchor node (plan.json names the nodes a kernel computes); emitters that fuse more record those too."""
        b = cls(table, group.name, family, group.outputs)
        b.nodes.append(group.anchor.name)
        return b

    @property
    def body(self) -> Block:
        """The lane loop's body, to build IR into."""
        return Block(self.numbering, self.lines)  # type: ignore[arg-type]

    @property
    def prologue(self) -> Block:
        """The per-texel prologue (run once per work-item, before the lane loop), to build IR into."""
        return Block(self.numbering, self.texel_lines)  # type: ignore[arg-type]

    def take_group(self) -> None:
        """Share each item among the schedule's group_size work-items (a long reduction's work-group)."""
        self.group_size = self.schedule.group_size if (self.schedule.group_size or 1) > 1 else None

    def _first_texel(self) -> Expr:
        columns, g = self.item_columns, self.g
        across = self.item_stride // columns  # tiles side by side in a band of the tile's rows
        band = self.texels_per_item // columns * self.item_stride  # texels in the band
        return g * band if across == 1 else flat_index([(div_index(g, across), band), (mod_index(g, across), columns)])

    def _tile_step(self) -> Expr:
        """Texel tt of the work-item's tile (row-major over rows and columns), from its first."""
        tt = self.tt
        if self.item_stride == self.item_columns:  # whole rows: the tile's texels are consecutive
            return tt
        if self.item_columns == 1:
            return tt * self.item_stride
        return div_index(tt, self.item_columns) * self.item_stride + mod_index(tt, self.item_columns)

    @property
    def first_element(self) -> Expr:
        """In the per-texel prologue: the flat index of the work-item's first element."""
        return self.t * 4 if self.texels_per_item == 1 else self._first_texel() * 4

    @property
    def lane_of_item(self) -> Expr:
        """In the lane loop: the lane's index among the work-item's 4 * texels_per_item outputs."""
        return self.lane if self.texels_per_item == 1 else self.tt * 4 + self.lane

    def finish(self, results: Sequence[Expr]) -> Kernel:
        """The kernel whose lane computes `results[k]` for output k."""
        texels, per_item, columns = self.out_textures[0].texels, self.texels_per_item, self.item_columns
        band = per_item // columns * self.item_stride  # texels in a band of the tiles' rows
        assert texels % band == 0, f"{texels} texels in bands of {band}"
        items, group, schedule = self.items, self.group_size, self.schedule
        masks = [t for t in self.out_textures if t.format == MASK_FORMATS["mask8"]]
        schedule.tile_rows, schedule.tile_columns = per_item // columns, columns  # what it used, for plan.json
        schedule.tile_stride, schedule.tiles_per_group = self.item_stride, self.tiles_per_group
        schedule.group_size = group or 1
        consecutive = [m for m in masks if m.layout.mask_pair_stride == 1]
        assert not consecutive or pairs_mask_bytes(schedule), \
            f"{self.name}: its tile splits the bytes of mask8 outputs its schedule did not store as r_mask4"
        assert all(pairs_rows(schedule) == m.layout.mask_pair_stride for m in masks if m not in consecutive), \
            f"{self.name}: its tile's rows are not the texels its mask8 outputs' bytes pair"
        pair = PAIR if consecutive and per_item % 2 else 1
        arguments = [self.argument_of("out", k, t) for k, t in enumerate(self.out_textures)]
        arguments += [self.argument_of("in", k, t) for k, t in enumerate(self.in_textures)]
        kernel = Block(self.numbering)
        item = self.t if per_item == 1 else self.g  # the item's index: its texel, or its place among the items
        launched = item if pair == 1 else _named("wi", INT)  # what a work-item is: an item, or a pair of them
        launches = -(-items // pair)
        if group is not None:  # group_size work-items per item: every branch below is uniform in them
            assert pair == 1 and not masks, "group kernels write float texels"
            self._group_header(kernel, item)
        elif self.staging_group is not None:  # whole groups (staging.plan_staging): none leaves before a barrier
            from fblc.codegen.kernels.staging import grouped_item  # staging imports this module

            assert pair == 1 and launches % self.staging_group == 0, f"{self.name}: staged"
            position = kir.call("get_global_id", 0, dtype=INT)
            grouped = grouped_item(position, self.lid, self.staging_group, *self.staging_order)
            kernel.add(kir.Declare(self.lid, kir.call("get_local_id", 0, dtype=INT)), kir.Stage(self.staged_arrays),
                       kir.Declare(item, kir.StagedChoice(position, grouped, INT) if self.staging_launch_order
                                   else grouped))
        else:
            kernel.add(kir.Declare(launched, kir.call("get_global_id", 0, dtype=INT)))
        kernel.add(kir.If(launched.ge(launches), [kir.Return()]))
        bytes_ = {k: _named(f"byte{k}", UINT) for k, t in enumerate(self.out_textures) if any(t is m for m in masks)}
        for k, byte in bytes_.items():  # bytes pairing the rows of a tile of several columns: one a column
            paired = self.out_textures[k].layout.mask_pair_stride != 1 and columns > 1
            kernel.add(kir.DeclareArray(byte, columns, (const(0, UINT),) * columns) if paired
                       else kir.Declare(byte, const(0, UINT), const=False))
        item_block = kernel
        if pair > 1:
            with kernel.loop("sub", 0, PAIR, name="sub") as (sub, item_block):
                item_block.add(kir.Declare(item, launched * pair + sub))
                if items % pair:
                    item_block.add(kir.If(item.ge(items), [kir.Break()]))
        self._item(item_block, results, arguments, bytes_)
        size = group * self.tiles_per_group if group else self.staging_group
        body = kir.KernelIR(self.name, arguments, kernel.statements, size)
        return Kernel(self.name, self.family, body, items * group if group else launches,
                      outputs=[t.id for t in self.out_textures], inputs=[t.id for t in self.in_textures],
                      nodes=list(self.nodes), group_size=size)

    @property
    def items(self) -> int:
        """The kernel's items: its output texels, or tiles of texels_per_item texels."""
        return self.out_textures[0].texels // self.texels_per_item

    def _group_header(self, kernel: Block, item: Var) -> None:
        """A group kernel's `item`, its work-item's `lid` and the item's __local `shared` floats; with
        tiles_per_group > 1, consecutive runs of group_size work-items hold consecutive items, each
        with its own slice of the group's __local `pool`, so the merges index `shared` alike."""
        group, tiles = self.group_size, self.tiles_per_group
        assert group is not None and self.items % tiles == 0, f"{self.items} items in groups of {tiles}"
        floats = max(group, self.shared_floats)
        local_id, group_id = kir.call("get_local_id", 0, dtype=INT), kir.call("get_group_id", 0, dtype=INT)
        if tiles == 1:
            kernel.add(kir.Declare(item, group_id), kir.Declare(self.lid, local_id),
                       kir.DeclareArray(self.shared, floats, local=True))
            return
        run = div_index(local_id, group)
        pool = _named("pool", kir.FLOAT)
        kernel.add(kir.Declare(item, group_id * tiles + run), kir.Declare(self.lid, mod_index(local_id, group)),
                   kir.DeclareArray(pool, tiles * floats, local=True),
                   kir.Declare(_named("shared", kir.DType("float", local_pointer=True)), pool + run * floats))

    def _item(self, block: Block, results: Sequence[Expr], arguments: list[kir.Argument],
              bytes_: dict[int, Var]) -> None:
        """One item (t or g declared): its per-texel prologue, then each of its texels. In a group kernel
        whose texels need no more merges, what follows the prologue's last merge is work-item 0's alone."""
        if self.texel_lines or self.texels_per_item > 1:  # the prologue sees its first texel's index
            self.declare_item_index(block, self.out_shape, TEXEL_INDEX)
            block.add(*self.texel_lines)
        if self.group_size is not None and not _merges(self.lines + self.lane_fallback + self.texel_reads):
            merged = max((k for k, s in enumerate(block.statements) if _merges([s])), default=-1) + 1
            writer = kir.If(self.lid.eq(0), block.statements[merged:])
            del block.statements[merged:]
            block.add(writer)
            block = Block(self.numbering, writer.then)
            self._one_writer = True
        if self.texels_per_item == 1:
            self._texel(block, results, arguments, bytes_)
            return
        rows = self._tile_rows(self.out_shape)
        # unrolled on a GPU, the tile's accumulators are indexed by constants (acc[tt * 4 + lane]) and stay in
        # registers, where an array indexed at run time spills to device memory (Mali's guide); a CPU's private
        # array is cached stack memory, and unrolled tiles cost PoCL a fifth more build time (T-ResNet 8.6 -> 10.5 s)
        unroll = not self.table.profile.cpu
        if self.run_reads:
            self._runs(block, results, arguments, bytes_, rows, unroll)
            return
        with block.loop("tt", 0, self.texels_per_item, unroll=unroll, name="tt") as (tt, texel):
            texel.add(kir.Declare(self.t, self._first_texel() + self._tile_step()))
            columns = self.item_columns  # texel tt of the tile: its row and column follow from the tile's
            first_row = None if rows is None else (rows[0] + div_index(tt, columns),
                                                   rows[1] + mod_index(tt, columns) * 4 if columns > 1 else rows[1])
            self._texel(texel, results, arguments, bytes_, first_row)

    def _runs(self, block: Block, results: Sequence[Expr], arguments: list[kir.Argument], bytes_: dict[int, Var],
              rows: tuple[Expr, Expr] | None, unroll: bool) -> None:
        """The tile's texels run by run (run_texels consecutive texels: a row's columns, or the whole tile
        when its rows are whole), each run's `run_reads` (per-channel values) once before its texels."""
        per, run_texels, columns = self.texels_per_item, self.run_texels, self.item_columns
        run_step = self.item_stride if run_texels < per else 0  # run r: row r of the tile
        out_numel = self.out_textures[0].numel
        with block.loop("rr", 0, per // run_texels, unroll=unroll, name="rr") as (rr, run):
            run.add(kir.Declare(self.tr, self._first_texel() + rr * run_step))
            declare_index(run, self.out_shape, self.tr * 4, RUN_FIRST)
            if self._reads_run_last:
                last = kir.call("min", self.tr * 4 + (4 * run_texels - 1), out_numel - 1)
                declare_index(run, self.out_shape, last, RUN_LAST)
            run.add(*self.run_reads)
            with run.loop("tc", 0, run_texels, unroll=unroll, name="tc") as (tc, texel):
                tt = self.tt
                texel.add(kir.Declare(tt, rr * run_texels + tc), kir.Declare(self.t, self.tr + tc))
                first_row = None if rows is None else (rows[0] + div_index(tt, columns),
                                                       rows[1] + mod_index(tt, columns) * 4 if columns > 1 else rows[1])
                self._texel(texel, results, arguments, bytes_, first_row)

    def declare_item_index(self, block: Block, shape: Sequence[int], prefix: str) -> list[Var]:
        """Declare `prefix0..` as the multi-index in `shape` of the work-item's first element."""
        rows = self._tile_rows(shape)
        if rows is None:
            return declare_index(block, shape, self.first_element, prefix)
        return declare_row_index(block, shape, *rows, prefix)

    def _tile_rows(self, shape: Sequence[int]) -> tuple[Expr, Expr] | None:
        """(flat row over the axes before the lane axis, element column in it) of the item's first
        texel, when a tile's rows are rows of `shape`'s lane axis (the contractions' tiles); else None."""
        per, stride, columns = self.texels_per_item, self.item_stride, self.item_columns
        axis = lane_axis(shape)
        if per == 1 or stride == 1 or axis is None or shape[axis] != 4 * stride:
            return None
        across = stride // columns  # tiles side by side in a band of the tile's rows
        column = mod_index(self.g, across) * (4 * columns) if across > 1 else const(0)
        return div_index(self.g, across) * (per // columns), column

    def _texel(self, block: Block, results: Sequence[Expr], arguments: list[kir.Argument],
               bytes_: dict[int, Var], first_row: tuple[Expr, Expr] | None = None) -> None:
        """Texel t: the lane loop computing `results` and the writes of every output (`first_row`: its
        first element's row and column, when its multi-index is cheaper from them than from t)."""
        out_numel, texels = self.out_textures[0].numel, self.out_textures[0].texels
        lane_results = [_named(f"r{k}", kir.ELEMENT_TYPES[t.kind]) for k, t in enumerate(self.out_textures)]
        # a texel within one row of the lane axis: its lanes' indices are its first element's, plus the
        # lane along that axis (one division per axis per texel, not per lane)
        in_one_row = lane_axis(self.out_shape) is not None
        wide = texel_wide.texel_form(self, results, in_one_row)
        if wide is None:
            block.add(*(kir.DeclareArray(r, 4, (const(0, r.dtype),) * 4) for r in lane_results))
        t = self.t
        if self.texel_reads or in_one_row:
            if first_row is not None:
                declare_row_index(block, self.out_shape, *first_row, TEXEL_FIRST)
            else:
                declare_index(block, self.out_shape, t * 4, TEXEL_FIRST)
        if self.texel_reads:
            if self._reads_last:
                declare_index(block, self.out_shape, kir.call("min", t * 4 + 3, out_numel - 1), TEXEL_LAST)
            block.add(*self.texel_reads)
        block.add(*self.lane_fallback)
        if wide is not None:
            block.add(*wide[0])
        else:
            # unrolled, the loop indexes r<k> and the accumulators by constants, which stay in registers; a
            # tensor that ends inside its last texel keeps the loop and its early exit (which LLVM cannot unroll)
            with block.loop("lane", 0, 4, unroll=out_numel % 4 == 0, name="lane") as (lane, body):
                self.lane_header(body, lane, in_one_row)
                body.add(*self.lines)
                for k, result in enumerate(results):
                    body.assign(kir.Element(lane_results[k], lane), result)
        for k, texture in enumerate(self.out_textures):
            lanes_of = [wide[1][k].lane(lane) if wide else kir.Element(lane_results[k], const(lane))
                        for lane in range(4)]
            argument = arguments[k]
            bits = reduce(operator.or_, [lanes_of[lane].ne(0) << lane for lane in range(4)])  # a mask's: lane l, bit l
            if texture.format == MASK_FORMATS["mask8"] and texture.layout.mask_pair_stride != 1:
                # bytes pairing the tile's rows P apart (reads.mask_position): written after the odd row's texel,
                # one byte a column of the tile (its texels run row by row)
                byte, (at, shift) = bytes_[k], mask_position(texture, t)
                if self.item_columns > 1:
                    byte = kir.Element(byte, mod_index(self.tt, self.item_columns))
                block.assign(byte, kir.Cast(UINT, bits) << shift, "|=")
                block.add(kir.If(shift.ne(0), [kir.Store(argument, at, kir.vector(kir.UINT4, byte, 0, 0, 0)),
                                               kir.Assign(byte, const(0, UINT))]))
            elif texture.format == MASK_FORMATS["mask8"]:  # texel t: nibble t & 1 of byte t >> 1, written after both
                byte = bytes_[k]
                block.assign(byte, kir.Cast(UINT, bits) << ((t & 1) * 4), "|=")
                odd = t & 1 if texels % 2 == 0 else (t & 1).logical_or(t.eq(texels - 1))  # an odd count's last byte
                block.add(kir.If(odd, [kir.Store(argument, t >> 1, kir.vector(kir.UINT4, byte, 0, 0, 0)),
                                       kir.Assign(byte, const(0, UINT))]))
            elif texture.format == MASK_FORMATS["mask4"]:  # the texel's 4 booleans as the low bits of byte t
                block.add(kir.Store(argument, t, kir.vector(kir.UINT4, bits, 0, 0, 0)))
            else:  # a group kernel's texel goes out from its work-item 0
                value = wide[1][k] if wide else kir.Vector(kir.TEXEL_TYPES[texture.kind], tuple(lanes_of))
                store = kir.Store(argument, t, value)
                several = self.group_size is not None and not self._one_writer
                block.add(kir.If(self.lid.eq(0), [store]) if several else store)

    def lane_header(self, block: Block, lane: Var, in_one_row: bool = False) -> None:
        """The lane loop's header: the lane's flat output index (`i` = t * 4 + `lane`), a break past the tensor's
        end, and its output multi-index (`in_one_row`: the texel's first element's (TEXEL_FIRST) plus the lane)."""
        numel, lanes = self.out_textures[0].numel, lane_axis(self.out_shape)
        block.add(kir.Declare(self.flat, self.t * 4 + lane))
        if numel % 4:
            block.add(kir.If(self.flat.ge(numel), [kir.Break()]))
        if not in_one_row:
            declare_index(block, self.out_shape, self.flat, OUT_INDEX)
            return
        for axis in range(len(self.out_shape)):
            first = _named(f"{TEXEL_FIRST}{axis}", INT)
            block.add(kir.Declare(_named(f"{OUT_INDEX}{axis}", INT), first + lane if axis == lanes else first))


def _merges(statements: Sequence[Statement]) -> bool:
    """Whether the statements hold a group's merge (a barrier, or a sub-group built-in's choice)."""
    return any(isinstance(s, (kir.Barrier, kir.WithFeature)) for s in kir.walk(statements))


def _named(name: str, dtype: kir.DType) -> Var:
    """A skeleton variable: a fixed name, no number."""
    return Var(name, 0, dtype, name)
