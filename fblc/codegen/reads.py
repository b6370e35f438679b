"""ValueReads: how a kernel reads the values it is given, the half of KernelBuilder that reads: a literal (a
one-element constant), one element of its texture (a strided view applies its root's strides) or, in the lane
loop, a read hoisted to once per output texel (`texel_reads`): the lanes' own texel, one element broadcast along
the lanes, or the at most two elements of a value constant over blocks of 4 or more output elements.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx_ir as ir

from fblc.bundle_format import BUFFER_C_TYPES
from fblc.codegen import ir as kir
from fblc.codegen.indexing import broadcast_view_index, flat_view_index, index_var
from fblc.codegen.cl import strides_of
from fblc.codegen.ir import INT, Block, Expr, Numbering, Statement, const, div_index, mod_index
from fblc.codegen.packed import dequantize_parameter_index, packed_element, unpack
from fblc.compiler.quantize import INT_FORMATS
from fblc.codegen.textures import Texture, TextureTable
from fblc.compiler.index_map import IndexMap, map_of, view_root
from fblc.compiler.values import attr, const_array, is_float, numel, static_shape

OUT_INDEX = "o"  # prefix of the output multi-index variables
FLAT_OUT_INDEX = "i"  # the lane loop's flat index of the output element, from which the OUT_INDEX variables come
TEXEL_FIRST = "z"  # prefix of the multi-index of the written texel's first element, seen by its hoisted reads
TEXEL_LAST = "zl"  # the same for its last element (within the tensor)
RUN_FIRST = "rz"  # the same for the first element of a tile's run of consecutive texels (KernelBuilder.run_texels)
RUN_LAST = "rzl"  # and for the run's last element (within the tensor)
ITEM_FIRST = "u"  # the multi-index of a work-item's first element (KernelBuilder's TEXEL_INDEX), in its prologue
#: the multi-index of a row-path tile's texel reduced on its own (contraction_paths.reduce_rows_apart)
TEXEL_ALONE = "zt"

Apply = Callable[[Expr], Expr]


def dtype_of(value: ir.Value) -> kir.DType:
    return kir.FLOAT if is_float(value) else INT


def mask_position(texture: Texture, texel: Expr) -> tuple[Expr, Expr]:
    """(byte, shift) of mask8 `texel`'s 4 bits in a mask whose bytes pair texels P = mask_pair_stride apart:
    byte (t / 2P) * P + t % P, its high nibble where (t / P) is odd (texel_layout.mask_byte_of)."""
    pair = texture.layout.mask_pair_stride
    byte = div_index(texel, 2 * pair) * pair + mod_index(texel, pair)
    return byte, (div_index(texel, pair) & 1) << 2


def _same(value: Expr) -> Expr:
    return value


class ValueReads:
    """The texture arguments a kernel reads and the reads it hoists out of its lane loop."""

    def __init__(self, table: TextureTable, out_shape: Sequence[int]) -> None:
        self.table = table
        self.out_shape = tuple(out_shape)
        self.in_textures: list[Texture] = []
        self.texel_reads: list[Statement] = []  # reads shared by a texel's 4 lanes, before its lane loop
        self._hoisted: dict[tuple[int, str], Expr] = {}
        self._reads_last = False  # a hoisted read needs the texel's last element (TEXEL_LAST)
        self._splits: dict[int, kir.Var] = {}  # block length -> the lanes of a texel in its first block
        #: a tile's runs of consecutive texels (KernelBuilder sets it): per-block values are read once per run
        #: (`run_reads`, before the run's texels, at the run's first texel `tr`) where blocks are that long
        self.run_texels = 1
        #: a tile's texels and their rows `item_stride` texels apart (KernelBuilder sets them), and its prologue
        self.texels_per_item, self.item_columns, self.item_stride = 1, 1, 1
        self.texel_lines: list[Statement] = []
        self._item_texels: dict[tuple[int, str], list[kir.Var]] = {}  # _channel_texels' reads by value and tile
        self.run_reads: list[Statement] = []
        self._run_splits: dict[int, kir.Var] = {}  # block length -> the elements of a run in its first block
        self._reads_run_last = False  # a run read needs the run's last element (RUN_LAST)
        self.numbering = Numbering()
        # the kernel skeleton's variables (KernelBuilder declares them): fixed names, no number
        self.t, self.g, self.tt, self.lane, self.flat, self.lid, self.tr = (
            kir.Var(name, 0, INT, name) for name in ("t", "g", "tt", "lane", FLAT_OUT_INDEX, "lid", "tr"))

    @property
    def hoisted(self) -> Block:
        return Block(self.numbering, self.texel_reads)  # type: ignore[arg-type]

    def constant_value(self, value: ir.Value) -> kir.Const | None:
        """A literal for a one-element constant; parameters and state (graph inputs) are never inlined."""
        array = None if value.is_graph_input() else const_array(value)
        if array is None or array.size != 1:
            return None
        return kir.Const(np.asarray(array).reshape(-1)[0].item(), dtype_of(value))

    def argument_of(self, role: str, index: int, texture: Texture) -> kir.Argument:
        kind = "uint" if texture.mask_elements else texture.kind
        return kir.Argument(role, index, kind, BUFFER_C_TYPES[texture.format], texture.layout)

    def input_argument(self, value: ir.Value) -> tuple[kir.Argument, Texture]:
        """The texture argument holding `value`'s root (added to the kernel's inputs on first use); for a weight
        dequantized as it is loaded (Texture.dequantized), a stand-in that no read uses (texel, element)."""
        texture = self.table.of(value)
        if texture.dequantized is not None:
            return kir.Argument("in", -1, "float", BUFFER_C_TYPES[texture.format], texture.layout), texture
        if texture not in self.in_textures:
            self.in_textures.append(texture)
        return self.argument_of("in", self.in_textures.index(texture), texture), texture

    def strided(self, value: ir.Value) -> tuple[ir.Value, IndexMap]:
        """The tensor that stores `value` and how `value` reads it (a remapped view reads its root)."""
        return view_root(value), map_of(value)

    def element(self, value: ir.Value, index: Expr) -> Expr:
        """Element `index` (flat in `value`'s own shape) of `value`."""
        if (inlined := self.constant_value(value)) is not None:
            return inlined
        index_map = map_of(value)
        if not index_map.contiguous:  # a strided view: unflatten, then apply the root strides
            index = flat_view_index(index_map, index)
        argument, texture = self.input_argument(value)
        if texture.dequantized is not None:
            return self.dequantized(texture.dequantized, index)
        if texture.packed_bits:
            return packed_element(argument, texture.packed_bits, INT_FORMATS[value.dtype].signed, index)
        per_byte = texture.mask_elements
        if per_byte and texture.layout.mask_pair_stride != 1:  # element i: lane i & 3 of texel i >> 2's nibble
            byte, shift = mask_position(texture, index >> 2)
            return kir.Cast(INT, kir.Load(argument, byte).lane(0) >> (shift + (index & 3))) & 1
        if per_byte:  # element i: bit i % per_byte of byte i / per_byte
            byte = kir.Load(argument, index >> (per_byte.bit_length() - 1))
            return kir.Cast(INT, byte.lane(0) >> (index & (per_byte - 1))) & 1
        return kir.Load(argument, index >> 2).lane(index & 3)

    def texel(self, argument: kir.Argument, texture: Texture, texel: Expr) -> kir.Load:
        """The whole texel `texel` of an input (trace builds record every Load: fblc.runtime.trace)."""
        if texture.mask_elements:
            raise AssertionError(f"the mask '{texture.name}' ({texture.format}) has no 4-element texels: read it "
                                 "through element()")
        if texture.dequantized is not None:  # elements 4t..4t+3 of the weight, dequantized in registers
            return self.dequantized_texel(texture.dequantized, texel)
        return kir.Load(argument, texel)

    def dequantized_texel(self, node: ir.Node, texel: Expr) -> Expr:
        """Elements 4t..4t+3 of DequantizeLinear `node`'s output where they lie in one row (the last axis a
        multiple of 4) and its data is packed: one word read (they are 16 or 32 consecutive bits), and one scale
        where they share it (a group along the last axis, or per channel of another) or four consecutive ones
        (groups along another axis); else element by element."""
        data, scale = node.inputs[0], node.inputs[1]
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        shape, parameter_shape = static_shape(data), static_shape(scale)
        argument, texture = self.input_argument(data)
        rank, per_tensor = len(shape), not parameter_shape or all(d == 1 for d in parameter_shape)
        axis = int(attr(node, "axis", 1)) % max(rank, 1)
        block, per_axis = int(attr(node, "block_size", 0)), len(parameter_shape) == 1 and not per_tensor
        last = axis == rank - 1
        shared = per_tensor or (per_axis and not last) or (not per_axis and last and block % 4 == 0)
        consecutive = not per_tensor and ((per_axis and last) or (not per_axis and not last))
        if not shape or shape[-1] % 4 or not texture.packed_bits or not (shared or consecutive):
            return kir.Vector(kir.FLOAT4, tuple(self.dequantized(node, texel * 4 + k) for k in range(4)))
        bits, signed = texture.packed_bits, INT_FORMATS[data.dtype].signed
        start = texel * (4 * bits)  # the first element's first bit
        word_index = start >> 5
        word = kir.Load(argument, word_index >> 2).lane(word_index & 3)
        coordinates = self.coordinates(shape, texel * 4)
        first = dequantize_parameter_index(node, coordinates)
        top = numel(parameter_shape) - 1
        values = []
        for k in range(4):
            at = const(0) if first is None else kir.call("min", first if shared else first + k, top, dtype=INT)
            q = unpack(word, bits, signed, (start & 31) + k * bits).cast(kir.FLOAT)
            if zero_point is not None:
                q = q - self.element(zero_point, at).cast(kir.FLOAT)
            values.append(q * self.element(scale, at).cast(kir.FLOAT))
        return kir.Vector(kir.FLOAT4, tuple(values))

    @staticmethod
    def coordinates(shape: Sequence[int], index: Expr) -> list[Expr]:
        """The multi-index of row-major element `index` of a tensor of `shape`."""
        return [mod_index(div_index(index, stride), extent) if k else div_index(index, stride)
                for k, (stride, extent) in enumerate(zip(strides_of(shape), shape))]

    def dequantized(self, node: ir.Node, index: Expr) -> Expr:
        """Element `index` (row-major) of DequantizeLinear `node`'s output, (q - zero point) * scale, from its packed
        integers and its scale's texture: the float weight is never stored. The parameter index is clamped:
        a texel read past the weight's last element (clamped reads of a tile's edge) stays inside the scales."""
        data, scale = node.inputs[0], node.inputs[1]
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        at = dequantize_parameter_index(node, self.coordinates(static_shape(data), index))
        at = const(0) if at is None else kir.call("min", at, numel(static_shape(scale)) - 1, dtype=INT)
        q = self.element(data, index).cast(kir.FLOAT)
        if zero_point is not None:
            q = q - self.element(zero_point, at).cast(kir.FLOAT)
        return q * self.element(scale, at).cast(kir.FLOAT)

    def broadcast(self, value: ir.Value, out_shape: Sequence[int], prefix: str = OUT_INDEX) -> Expr:
        """`value` numpy-broadcast to `out_shape`, at the multi-index `prefix0, prefix1..`; in the lane
        loop read once per texel where its 4 lanes lie in one texel (_texel_read)."""
        if (inlined := self.constant_value(value)) is not None:
            return inlined
        root, index_map = self.strided(value)
        if prefix == OUT_INDEX and tuple(out_shape) == tuple(self.out_shape):
            hoisted = self._texel_read(root, index_map)
            if hoisted is not None:
                return hoisted
            if index_map.contiguous and tuple(index_map.shape) == self.out_shape:
                return self.element(root, self.flat)  # the output's own order
        return self.element(root, broadcast_view_index(index_map, out_shape, prefix))

    def channel(self, value: ir.Value, apply: Apply = _same) -> Expr:
        """In the lane loop: the 1-D `value` (one element per channel, output axis 1: a conv's bias) at the
        output element's channel, passed through `apply`; once per texel where it can (_texel_read)."""
        if (inlined := self.constant_value(value)) is not None:
            return apply(inlined)
        root, index_map = self.strided(value)
        trailing = len(self.out_shape) - 2  # the axes after the channel's
        spread = IndexMap(tuple(index_map.shape) + (1,) * trailing, tuple(index_map.strides) + (0,) * trailing,
                          index_map.offset, index_map.folds + ((),) * trailing if index_map.folded else ())
        # one hoisted read per value and applied formula; unapplied, the key of broadcast()'s reads, which share it
        key = "" if apply is _same else repr(apply(kir.Var("x", 0, kir.FLOAT, "x")))
        hoisted = self._texel_read(root, spread, apply, key=key)
        return hoisted if hoisted is not None else apply(self.element(value, index_var(OUT_INDEX, 1)))

    def _texel_read(self, root: ir.Value, index_map: IndexMap, apply: Apply = _same, key: str = "") -> Expr | None:
        """The lane's element of `root` read through `index_map` (broadcast to the output), passed
        through `apply`, from a texel read once per output texel (or _block_read's elements); None when
        an output texel's 4 lanes map neither to the 4 lanes of one texel nor to one element."""
        out = self.out_shape
        texture = self.table.of(root)
        own = index_map.contiguous and tuple(index_map.shape) == tuple(out)  # an optimizer's operands
        if not out or texture.mask_elements:
            return self._mask_bits(root, texture) if out and own else None
        if not own and not index_map.folded and all(size == 1 or stride == 0
                                                    for size, stride in zip(index_map.shape, index_map.strides)):
            return apply(self._whole_read(root, index_map.offset))
        whole = None if own else self._channel_texels(root, index_map, apply, key)
        if whole is not None:
            return whole
        if not own and out[-1] % 4:
            return self._block_read(root, index_map, apply, key)
        # else the lanes' own texel (own order: texel t; else it must be aligned), or, broadcast along
        # the rows (a row statistic), one element for all 4 lanes, any alignment
        one_element = not own and (not index_map.shape or index_map.shape[-1] == 1)
        if not own and not one_element and not index_map.lanes_read_texels():
            return None
        if one_element and self.run_texels > 1:  # once per run of a tile's texels where blocks hold a run
            per_run = self._block_read(root, index_map, apply, key)
            if per_run is not None:
                return per_run
        first = broadcast_view_index(index_map, out, TEXEL_FIRST)
        cache = (id(root), repr(first))
        if cache not in self._hoisted:
            argument, _ = self.input_argument(root)
            if one_element:
                self._hoisted[cache] = self.hoisted.let(self.element(root, first), "H")
            else:
                texel = self.hoisted.let(self.texel(argument, texture, first >> 2), "H")
                self._hoisted[cache] = texel.lane(self.lane)
        return apply(self._hoisted[cache])

    def _whole_read(self, root: ir.Value, offset: int) -> Expr:
        """Element `offset` of `root`, the one element a view reads for every output element (every axis of
        size 1 or stride 0: an optimizer's learning rate or bias correction, a graph input and so never a
        literal; a mean's gradient broadcast): read once per work-item, in its prologue where it holds a tile
        of texels, not once per lane (in image storage each read is a call: MobileNetV2's fused weight-gradient
        updates read two such scalars 64 times a work-item)."""
        cache = (id(root), f"whole {offset}")
        if cache not in self._hoisted:
            block = Block(self.numbering, self.texel_lines) if self.texels_per_item > 1 else self.hoisted
            self._hoisted[cache] = block.let(self.element(root, const(offset)), "H")  # type: ignore[arg-type]
        return self._hoisted[cache]

    def _mask_bits(self, root: ir.Value, texture: Texture) -> Expr:
        """The lane's element of a saved mask read in the output's own order (an activation's gradient):
        a texel's 4 elements are 4 bits of one byte (r_mask8: nibble t & 1 of byte t >> 1; r_mask4: byte t),
        read once per output texel, not once per lane."""
        cache = (id(root), "mask bits")
        if cache not in self._hoisted:
            argument, _ = self.input_argument(root)
            per_byte, first = texture.mask_elements, self.t * 4
            if texture.layout.mask_pair_stride != 1:  # bytes pairing texels P apart (mask_position)
                at, shift = mask_position(texture, self.t)
                byte = self.hoisted.let(kir.Load(argument, at).lane(0), "H")
                self._hoisted[cache] = byte >> shift
            else:
                byte = self.hoisted.let(kir.Load(argument, first >> (per_byte.bit_length() - 1)).lane(0), "H")
                self._hoisted[cache] = byte >> (first & (per_byte - 1))  # the texel's nibble in the low bits
        return kir.Cast(INT, self._hoisted[cache] >> self.lane) & 1

    def _block_read(self, root: ir.Value, index_map: IndexMap, apply: Apply, key: str) -> Expr | None:
        """The lane's element of `root` when it is constant over blocks of at least 4 consecutive output
        elements (a conv's per-channel epilogue): a texel's lanes see at most two, its first lane's and
        (when it straddles two blocks) its last's, read and passed through `apply` once per texel; one, its
        first lane's, where the block length is a multiple of 4 (no texel straddles)."""
        out = self.out_shape
        view = (1,) * (len(out) - len(index_map.shape)) + tuple(index_map.shape)
        block = 1
        for axis in reversed(range(len(out))):
            if view[axis] != 1:
                break
            block *= out[axis]
        if block < 4 or block == int(np.prod(out)):
            return None  # lanes of several elements, or one element for the whole tensor (element() inlines it)
        if self.run_texels > 1 and block >= 4 * self.run_texels:
            return self._run_read(root, index_map, apply, key, block)
        first = broadcast_view_index(index_map, out, TEXEL_FIRST)
        cache = (id(root), f"block {first!r} {key}")
        if cache not in self._hoisted and block % 4 == 0:
            # blocks start at multiples of 4, as texels do: a texel lies in one block, its first lane's element
            dtype = dtype_of(root) if apply is _same else kir.FLOAT
            self._hoisted[cache] = self.hoisted.let(apply(self.element(root, first)), "H", dtype)
        if cache not in self._hoisted:
            last = broadcast_view_index(index_map, out, TEXEL_LAST)
            reads = self.hoisted
            split = self._splits.get(block)
            if split is None:  # one per block length, shared by every value constant over such blocks
                split = self._splits[block] = reads.let(const(block) - mod_index(self.t * 4, block), "n")
            dtype = dtype_of(root) if apply is _same else kir.FLOAT  # an applied value is float math (BN's rsqrt)
            head = reads.let(apply(self.element(root, first)), "H", dtype)
            # the last lane's element is read only by a texel that straddles two blocks
            tail = reads.let(kir.select(split.ge(4), head, apply(self.element(root, last))), "H", dtype)
            self._hoisted[cache] = kir.select(self.lane.lt(split), head, tail)
            self._reads_last = True
        return self._hoisted[cache]

    def _channel_texels(self, root: ir.Value, index_map: IndexMap, apply: Apply, key: str) -> Expr | None:
        """The lane's per-channel value (one element per output channel: a conv's epilogue) where the
        tile's rows are whole planes of consecutive channels from a multiple of 4 (rows by 4 or 8, `item_stride`
        texels a plane: conv_schedules.channel_rows' row_step 1): the rows' values are rows / 4 whole texels,
        read once per work-item in its prologue, the texel's value a lane of one of them, not one texel per row
        for one lane. None elsewhere (and for a value whose channels are not consecutive elements from a
        multiple of 4)."""
        out, per, columns = self.out_shape, self.texels_per_item, self.item_columns
        rows = per // columns
        if per == 1 or rows % 4 or len(out) < 3 or 4 * self.item_stride != np.prod(out[2:]) or out[1] % rows:
            return None
        lead = len(out) - len(index_map.shape)
        varying = [axis for axis, size in enumerate(index_map.shape) if size != 1]
        if index_map.folded or varying != [1 - lead] or index_map.strides[1 - lead] != 1 or index_map.offset % 4:
            return None
        dtype = dtype_of(root) if apply is _same else kir.FLOAT  # an applied value is float math (BN's rsqrt)
        first = broadcast_view_index(index_map, out, TEXEL_FIRST)
        cache = (id(root), f"channel texels {first!r} {key}")
        if cache in self._hoisted:
            return self._hoisted[cache]
        item = broadcast_view_index(index_map, out, ITEM_FIRST)  # the tile's first channel's element
        texels_key = (id(root), repr(item))
        if texels_key not in self._item_texels:
            argument, texture = self.input_argument(root)
            prologue = Block(self.numbering, self.texel_lines)
            q = prologue.let(item >> 2, "q")
            self._item_texels[texels_key] = [prologue.let(self.texel(argument, texture, q + k if k else q), "H")
                                             for k in range(rows // 4)]
        texels, reads = self._item_texels[texels_key], self.hoisted
        texel: Expr = texels[-1]
        if len(texels) > 1:  # the one that holds the texel's channel
            which = reads.let((first - item) >> 2, "j")
            for k in reversed(range(len(texels) - 1)):
                texel = kir.select(which.eq(k), texels[k], texel)
        self._hoisted[cache] = reads.let(apply(texel.lane(first & 3)), "H", dtype)
        return self._hoisted[cache]

    def _run_read(self, root: ir.Value, index_map: IndexMap, apply: Apply, key: str, block: int) -> Expr:
        """_block_read once per run of `run_texels` consecutive texels of a tile, not per texel: blocks at
        least as long as the run give its elements at most two values, its first element's and (when it
        straddles two blocks) its last's; one where blocks are multiples of the run's elements (runs start
        at multiples of them: KernelBuilder's tiles are aligned to their runs)."""
        out, span = self.out_shape, 4 * self.run_texels
        first = broadcast_view_index(index_map, out, RUN_FIRST)
        cache = (id(root), f"run {first!r} {key}")
        if cache in self._hoisted:
            return self._hoisted[cache]
        reads = Block(self.numbering, self.run_reads)  # type: ignore[arg-type]
        dtype = dtype_of(root) if apply is _same else kir.FLOAT  # an applied value is float math (BN's rsqrt)
        head = reads.let(apply(self.element(root, first)), "H", dtype)
        if block % span == 0:
            self._hoisted[cache] = head
            return head
        split = self._run_splits.get(block)
        if split is None:  # one per block length, shared by every value constant over such blocks
            split = self._run_splits[block] = reads.let(const(block) - mod_index(self.tr * 4, block), "n")
        last = broadcast_view_index(index_map, out, RUN_LAST)
        # the last element's value is read only by a run that straddles two blocks
        tail = reads.let(kir.select(split.ge(span), head, apply(self.element(root, last))), "H", dtype)
        within = (self.t - self.tr) * 4 + self.lane  # the lane's element among the run's
        self._hoisted[cache] = kir.select(within.lt(split), head, tail)
        self._reads_run_last = True
        return self._hoisted[cache]
