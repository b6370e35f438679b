"""Textures: which values get one, where their texels sit, and in which image format (docs/ARCHITECTURE.md §3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx_ir as ir

from fblc.bundle_format import FLOAT_FORMATS, MASK_FORMATS, image_bytes
from fblc.compiler import keys
from fblc.errors import FblcError
from fblc.compiler.values import is_float, numel, static_shape
from fblc.compiler.index_map import view_root
from fblc.compiler.quantize import INT_FORMATS, packed_words
from fblc.passes.fuse import IN_READERS
from fblc.profiles import Profile
from fblc.texel_layout import MASK_ELEMENTS, TexelLayout, flat_layout

if TYPE_CHECKING:
    from fblc.codegen.schedule import Schedule


#: the largest element or lane index a kernel computes: its indices are 32-bit `int`
MAX_INDEX = 2**31 - 1


@dataclass
class Texture:
    id: int
    name: str  # the value it was made for (the root of its views)
    shape: tuple[int, ...]
    kind: str  # "float" or "int"
    format: str  # a key of bundle_format.TEXTURE_FORMATS
    layout: TexelLayout
    values: list[str] = field(default_factory=list)  # every value name stored here (views included)
    #: bits per element of a packed integer tensor (a DequantizeLinear's int4/int8 data: fblc.compiler.quantize
    #: packs 32 / bits of them a 32-bit word, 4 words a texel); 0 for the others
    packed_bits: int = 0
    #: a weight its contraction readers dequantize as they load it (fuse.IN_READERS): this DequantizeLinear, and
    #: the texture is no texture (id -1, in no table, allocated nowhere): texel t is elements 4t..4t+3 of the
    #: weight in row-major order, computed from the packed integers and scales (reads.ValueReads.texel)
    dequantized: ir.Node | None = None

    @property
    def width(self) -> int:
        return self.layout.width

    @property
    def height(self) -> int:
        return self.layout.height

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def texels(self) -> int:
        """4-element texels of the tensor (what kernels launch over; a mask's image holds 2 per byte; a packed
        tensor's texels hold 4 words)."""
        if self.packed_bits:
            return max(1, -(-packed_words(self.numel, self.packed_bits) // 4))
        return max(1, -(-self.numel // 4))

    @property
    def mask_elements(self) -> int:
        """Elements per image byte of an r_mask texture (8 or 4); 0 for the others."""
        return MASK_ELEMENTS.get(self.layout.kind, 0)

    @property
    def image_bytes(self) -> int:
        """Its image's bytes: the padded texels in its format (bytes of a mask image)."""
        return image_bytes(self.format, self.width, self.height)


def packed_bits(value: ir.Value) -> int:
    """Bits per element where `value` is stored packed: an int4/int8 tensor that DequantizeLinear reads (its data
    or zero point); else 0. Nothing else reads such a tensor, so its texture needs no other layout."""
    form = INT_FORMATS.get(value.dtype) if value.dtype is not None else None
    if form is None or not value.uses() or value.is_graph_input():  # a feed is uploaded as it comes, one per element
        return 0
    return form.bits if all(use.node.op_type == "DequantizeLinear" for use in value.uses()) else 0


class TextureTable:
    """Texture per value root, with the target's image limits checked."""

    def __init__(self, profile: Profile, float_format: str, tiled: bool = False) -> None:
        self.profile = profile
        self.float_format = float_format
        self.tiled = tiled  # R-Tile codegen (--layout rtile): kernels compute 2-D output tiles
        self.textures: list[Texture] = []
        self._by_root: dict[int, Texture] = {}
        #: each kernel's schedule by kernel name (kernels/schedules.py), which its builder takes
        self.schedules: dict[str, Schedule] = {}
        #: saved masks stored as r_mask4, or as r_mask8 with bytes pairing a tile's rows, because a schedule's
        #: tile splits their consecutive texels, where the graph's layouts do not say so already (a step lowered
        #: without the kernel_schedules pass)
        self.mask_layouts: dict[str, TexelLayout] = {}
        self._dequantized: dict[int, Texture] = {}

    def of(self, value: ir.Value) -> Texture:
        root = view_root(value)
        producer = root.producer()
        if producer is not None and producer.metadata_props.get(keys.KERNEL) == IN_READERS:
            return self._dequantized_in_readers(root, producer)
        texture = self._by_root.get(id(root)) or self._new(root)
        if value.name not in texture.values:
            texture.values.append(value.name)
        return texture

    def _dequantized_in_readers(self, root: ir.Value, node: ir.Node) -> Texture:
        """The stand-in texture of a weight dequantized where its readers load it (Texture.dequantized)."""
        if id(root) not in self._dequantized:
            shape = static_shape(root)
            texels = max(1, -(-numel(shape) // 4))
            layout = flat_layout(texels, self.profile.placement_limits(texels)[0])
            self._dequantized[id(root)] = Texture(-1, root.name, shape, "float", self.float_format, layout,
                                                  [root.name], dequantized=node)
        return self._dequantized[id(root)]

    def _new(self, value: ir.Value) -> Texture:
        """The texture of root `value`, refused where the kernels' indices or the target's images cannot hold it."""
        shape = static_shape(value)
        kind = "float" if is_float(value) else "int"
        bits = packed_bits(value)
        texels = max(1, -(-(packed_words(numel(shape), bits) if bits else numel(shape)) // 4))
        layout = keys.layout_of(value) if not bits else None  # a packed tensor is read word by word: flat
        layout = layout or flat_layout(texels, self.profile.placement_limits(texels)[0])
        if layout.kind == "mask8" and value.name in self.mask_layouts:
            layout = self.mask_layouts[value.name]
        if max(numel(shape), layout.width * layout.height * 4) > MAX_INDEX:
            raise FblcError(
                f"tensor '{value.name}' {list(shape)} has {numel(shape):,} elements in a {layout.width} x "
                f"{layout.height} texture, beyond the {MAX_INDEX:,} that the kernels' 32-bit int indices address",
                "use a smaller batch or sequence (--input-shape)")
        if layout.height > self.profile.image2d_max_height or layout.width > self.profile.image2d_max_width:
            raise FblcError(
                f"tensor '{value.name}' {list(shape)} needs a {layout.width} x {layout.height} texture, beyond "
                f"{self.profile.name}'s image limit of {self.profile.image2d_max_width} x "
                f"{self.profile.image2d_max_height}", "use a smaller batch or sequence, or a target with larger images")
        storage = value.metadata_props.get(keys.STORAGE)  # storage_precision's annotation, else the table's --dtype
        texture_format = ((FLOAT_FORMATS[storage] if storage else self.float_format) if kind == "float"
                          else MASK_FORMATS.get(layout.kind, "rgba_i32"))  # saved masks: bits of an r_mask image
        texture = Texture(len(self.textures), value.name, shape, kind, texture_format, layout, packed_bits=bits)
        self.textures.append(texture)
        self._by_root[id(value)] = texture
        return texture
