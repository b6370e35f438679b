"""ValueReads: how a kernel reads the values it is given, the half of KernelBuilder that reads.

A value is read as a literal (a one-element constant), as one element of its texture
(`load`: RDF/RDI of the element's texel, then its lane; a strided view unflattens the index
and applies its root's strides) or, in the lane loop, from a texel read once per output texel
before the lane loop (`texel_reads`): the lanes' own texel, one element broadcast along the
lanes, or the at most two elements of a value constant over blocks of 4 or more output elements
(a conv's per-channel epilogue).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

from fblc.codegen.cl import broadcast_view_index, div_index, literal, mod_index, view_index
from fblc.codegen.textures import Texture, TextureTable
from fblc.compiler.index_map import IndexMap, map_of, row_major_strides, view_root
from fblc.compiler.values import const_array, is_float

OUT_INDEX = "o"  # prefix of the output multi-index variables
FLAT_OUT_INDEX = "i"  # the lane loop's flat index of the output element, from which the OUT_INDEX variables come
TEXEL_FIRST = "z"  # prefix of the multi-index of the written texel's first element, seen by its hoisted reads
TEXEL_LAST = "zl"  # the same for its last element (within the tensor)


def ctype_of(value: ir.Value) -> str:
    return "float" if is_float(value) else "int"


class ValueReads:
    """The texture arguments a kernel reads and the reads it hoists out of its lane loop."""

    def __init__(self, table: TextureTable, out_shape: Sequence[int]) -> None:
        self.table = table
        self.out_shape = tuple(out_shape)
        self.in_textures: list[Texture] = []
        self.texel_reads: list[str] = []  # reads shared by a texel's 4 lanes, before its lane loop
        self._hoisted: dict[tuple[int, str], str] = {}
        self._reads_last = False  # a hoisted read needs the texel's last element (TEXEL_LAST)
        self._splits: dict[int, str] = {}  # block length -> the lanes of a texel in its first block
        self._counter = 0

    def fresh(self, hint: str) -> str:
        """A new variable name: `hint` and a number."""
        self._counter += 1
        return f"{hint}{self._counter}"

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
            index = view_index(index_map, [mod_index(div_index(f"({index})", inner), dim) for dim, inner
                                           in zip(index_map.shape, row_major_strides(index_map.shape))])
        arg, texture = self._argument(value)
        per_byte = texture.mask_elements
        if per_byte:  # element i: bit i % per_byte of byte i / per_byte
            byte = f"({index}) >> {per_byte.bit_length() - 1}"
            return f"ldm({arg}, ({index}) & {per_byte - 1}, {texture.coord(byte)})"
        lane = "lane_f" if texture.kind == "float" else "lane_i"
        return f"{lane}({self.read_texel(arg, texture, f'({index}) >> 2')}, ({index}) & 3)"

    @staticmethod
    def read_texel(arg: str, texture: Texture, texel: str) -> str:
        """C expression: the whole texel `texel` (a C int expression) of argument `arg`. Every read of a
        texture goes through RDF/RDI, which trace builds record (fblc.runtime.trace)."""
        if texture.mask_elements:
            raise AssertionError(f"the mask '{texture.name}' ({texture.format}) has no 4-element texels: read it "
                                 "through load()")
        return f"{'RDF' if texture.kind == 'float' else 'RDI'}({arg}, {texture.coord(texel)})"

    def load_broadcast(self, value: ir.Value, out_shape: Sequence[int], prefix: str = OUT_INDEX) -> str:
        """C expression: `value` numpy-broadcast to `out_shape`, at the multi-index `prefix0, prefix1..`.

        In the lane loop, a value whose 4 lanes lie in one texel (the texel's own, or one element
        broadcast along the lanes) is read once per texel, before the lane loop."""
        inlined = self.constant_scalar(value)
        if inlined is not None:
            return inlined
        root, index_map = self.strided(value)
        if prefix == OUT_INDEX and tuple(out_shape) == tuple(self.out_shape):
            hoisted = self._texel_read(root, index_map)
            if hoisted is not None:
                return hoisted
            if index_map.contiguous and tuple(index_map.shape) == self.out_shape:
                return self.load(root, FLAT_OUT_INDEX)  # the output's own order (a saved mask): no index arithmetic
        return self.load(root, broadcast_view_index(index_map, out_shape, prefix))

    def load_channel(self, value: ir.Value, axis: int = 1, apply: str = "{}") -> str:
        """C expression, in the lane loop: the 1-D `value` (one element per index of output `axis`,
        e.g. a conv's bias, BatchNormalization's statistics) at the output element's index there,
        passed through the C template `apply` ("{}" where the value goes); read, and applied, once per
        texel where its lanes share one or two elements (BatchNormalization's rsqrt of the variance)."""
        inlined = self.constant_scalar(value)
        if inlined is not None:
            return apply.format(inlined)
        root, index_map = self.strided(value)
        trailing = len(self.out_shape) - 1 - axis
        spread = IndexMap(tuple(index_map.shape) + (1,) * trailing, tuple(index_map.strides) + (0,) * trailing,
                          index_map.offset, index_map.folds + ((),) * trailing if index_map.folded else ())
        hoisted = self._texel_read(root, spread, apply)
        return hoisted if hoisted is not None else apply.format(self.load(value, f"{OUT_INDEX}{axis}"))

    def _texel_read(self, root: ir.Value, index_map: IndexMap, apply: str = "{}") -> str | None:
        """The lane's element of `root` read through `index_map` (broadcast to the output) from a
        texel read once per output texel, passed through the C template `apply` (once per element read
        where blocks of a row share it, _block_read); None when the 4 lanes of an output texel do not
        map to the 4 lanes of one texel (as they always do when `root` is read in the output's own
        order), or to one element."""
        out = self.out_shape
        texture = self.table.of(root)
        if not out or texture.mask_elements:
            return None
        own = index_map.contiguous and tuple(index_map.shape) == tuple(out)  # an optimizer's operands
        if own:  # the output's own element order, any shape: texel t holds the 4 lanes
            one_element = False
        elif out[-1] % 4:
            return self._block_read(root, index_map, apply)
        elif index_map.shape and index_map.shape[-1] != 1:  # the lanes' own texel: it must be aligned
            if not index_map.lanes_read_texels():
                return None
            one_element = False
        else:  # broadcast along the rows (a row statistic): one element for all 4 lanes, any alignment
            one_element = True
        first = broadcast_view_index(index_map, out, TEXEL_FIRST)
        key = (id(root), first)
        if key not in self._hoisted:
            arg, _ = self._argument(root)
            name = self.fresh("H")
            if one_element:
                self._hoisted[key] = name
                self.texel_reads.append(f"const {ctype_of(root)} {name} = {self.load(root, first)};")
            else:
                vector = "float4" if texture.kind == "float" else "int4"
                self._hoisted[key] = f"{'lane_f' if texture.kind == 'float' else 'lane_i'}({name}, lane)"
                self.texel_reads.append(f"const {vector} {name} = {self.read_texel(arg, texture, f'({first}) >> 2')};")
        return apply.format(self._hoisted[key])

    def _block_read(self, root: ir.Value, index_map: IndexMap, apply: str = "{}") -> str | None:
        """The lane's element of `root`, when it is constant over blocks of at least 4 consecutive
        output elements (a per-channel value of a conv's epilogue): a texel's lanes then see at most
        two elements, its first lane's and its last's, read once per texel (the last only when the
        texel straddles two blocks), each passed through the C template `apply` there. None otherwise."""
        out = self.out_shape
        view = (1,) * (len(out) - len(index_map.shape)) + tuple(index_map.shape)
        block = 1
        for axis in reversed(range(len(out))):
            if view[axis] != 1:
                break
            block *= out[axis]
        if block < 4 or block == int(np.prod(out)):
            return None  # lanes of several elements, or one element for the whole tensor (load() inlines it)
        first = broadcast_view_index(index_map, out, TEXEL_FIRST)
        key = (id(root), f"block {first} {apply}")
        if key not in self._hoisted:
            last = broadcast_view_index(index_map, out, TEXEL_LAST)
            split = self._splits.get(block)
            if split is None:  # one per block length, shared by every value constant over such blocks
                split = self._splits[block] = self.fresh("n")
                self.texel_reads.append(f"const int {split} = {block} - {mod_index('(t * 4)', block)};  // lanes in block 1")
            head, tail = self.fresh("H"), self.fresh("H")
            ctype = ctype_of(root) if apply == "{}" else "float"  # a template is float math (BatchNorm's rsqrt)
            head_value, tail_value = (apply.format(self.load(root, index)) for index in (first, last))
            # the last lane's element is read only by a texel that straddles two blocks
            self.texel_reads += [f"const {ctype} {head} = {head_value};",
                                 f"const {ctype} {tail} = {split} >= 4 ? {head} : {tail_value};"]
            self._hoisted[key] = f"(lane < {split} ? {head} : {tail})"
            self._reads_last = True
        return self._hoisted[key]
