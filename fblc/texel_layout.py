"""Where each texel of a tensor sits in its image2d_t: the flat layout and the R-Tile layout.

Shared by the passes (rtile_select scores candidates with it), the codegen (kernels address
texels through it) and the runtimes (they pack and unpack host data through it).

A tensor's elements are numbered row-major; texel t holds elements 4t..4t+3.
- flat: texel t at (t % width, t / width). The runtimes' interchange layout: data inputs and
  the loss always use it (parameters and optimizer state may be rtile: the runtimes unpack them
  through their layout, the native runner with its own texel_xy).
- mask8: a boolean tensor saved for the backward, one bit per element in a one-byte (R uint8)
  image addressed flat by byte: element i is bit i & 7 of byte i >> 3, LSB first, as the public
  MemFLoRA code packs its masks (32x less than int32). Texel t (elements 4t..4t+3) is then the
  low (t even) or high (t odd) nibble of byte t >> 1, so a kernel writes whole bytes by giving a
  work-item both texels of each byte (fblc.codegen.builder). The image is sized in bytes.
  With `mask_pair_stride` P > 1 a byte pairs texels P apart instead: texel t is nibble (t / P) & 1
  of byte (t / 2P) * P + t % P (P = 1: the consecutive pairing above), for a writer whose 2-D tile
  holds an even number of rows P texels apart (rows 2j and 2j + 1 share their bytes) where its
  consecutive texels lie in two work-items: still one bit per element, no r_mask4 fallback.
- mask4: mask8's fallback for a writer whose work-items cannot cover whole bytes either way (a 2-D
  tile of an odd number of rows whose consecutive texels lie in two work-items): byte t holds
  texel t's 4 elements in its low bits, 2 bits per element.
- rtile (R-Tile): the tensor is a matrix [rows, cols] (cols = its last axis, a
  multiple of 4, so a texel never spans two rows) cut into tiles of tile_h rows x tile_w
  elements. Intra-tile packing `strip` lays a tile's rows side by side in one texel row (for
  tiles whose row is no wider than a cache line); `block` keeps the tile 2-D. Tiles are
  numbered row-major over the tile grid, or column-major when `arrangement` is "columns"
  (the axis with more tiles runs horizontally), and placed `tiles_per_row` to an image row.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

#: mask kind -> tensor elements per image byte
MASK_ELEMENTS = {"mask8": 8, "mask4": 4}
NARROWEST = 16  # a mask image that needs several rows is at least max_width / NARROWEST bytes wide


def reciprocal(divisor: int) -> tuple[int, int]:
    """(m, s): x / divisor == (x * m) >> (32 + s) for every 0 <= x < 2^31, divisor >= 2 (Granlund and
    Montgomery, 1994: with l = ceil(log2 divisor), m = ceil(2^(31 + l) / divisor) < 2^32 is exact for
    31-bit dividends; kernel indices stay below 2^31, codegen.textures.MAX_INDEX refuses larger tensors)."""
    bits = (divisor - 1).bit_length()
    return -(-(1 << (31 + bits)) // divisor), bits - 1


def div_index(index: str, divisor: int) -> str:
    """OpenCL C `index / divisor` for a non-negative int index below 2^31, without a division: a shift
    for a power of two (a shift floors, a division truncates: the same for non-negative values only),
    else a 64-bit multiply by the divisor's reciprocal and a shift. GPUs have no integer divider, and a
    driver's compiler need not strength-reduce a division by a literal itself."""
    if divisor == 1:
        return index
    if divisor & (divisor - 1) == 0:
        return f"({index} >> {divisor.bit_length() - 1})"
    multiplier, shift = reciprocal(divisor)
    return f"((int)(((ulong)({index}) * {multiplier}u) >> {32 + shift}))"


def mod_index(index: str, modulus: int) -> str:
    """OpenCL C `index % modulus` for a non-negative int index: a mask for a power of two, else the
    index less `modulus` times its quotient (div_index)."""
    if modulus == 1:
        return "0"
    if modulus & (modulus - 1) == 0:
        return f"({index} & {modulus - 1})"
    return f"({index} - {div_index(index, modulus)} * {modulus})"


@dataclass(frozen=True)
class TexelLayout:
    kind: str  # "flat", "rtile", or a mask kind (MASK_ELEMENTS)
    width: int  # image width, texels
    height: int
    rows: int = 1
    cols: int = 4
    tile_h: int = 1
    tile_w: int = 4  # elements (a multiple of 4)
    packing: str = "block"  # "strip" or "block"
    arrangement: str = "rows"  # "rows" or "columns"
    tiles_per_row: int = 1
    mask_pair_stride: int = 1  # mask8: texels apart the two nibbles of a byte lie (see the module docstring)

    # geometry -----------------------------------------------------------------------------------
    @property
    def tile_texels_w(self) -> int:
        return self.tile_w // 4

    @property
    def tile_grid(self) -> tuple[int, int]:
        """(tile rows, tile columns) of the matrix."""
        return -(-self.rows // self.tile_h), -(-(self.cols // 4) // self.tile_texels_w)

    @property
    def tile_footprint(self) -> tuple[int, int]:
        """(width, height) in texels of one placed tile."""
        if self.packing == "strip":
            return self.tile_h * self.tile_texels_w, 1
        return self.tile_texels_w, self.tile_h

    def coords(self, texels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of texel indices `texels` (numpy, vectorised); of byte indices under a mask kind."""
        t = np.asarray(texels, dtype=np.int64)
        if self.kind == "flat" or self.kind in MASK_ELEMENTS:
            return t % self.width, t // self.width
        c4, tw4, th = self.cols // 4, self.tile_texels_w, self.tile_h
        ntr, ntc = self.tile_grid
        r, q = t // c4, t % c4
        tr, ir, tc, iq = r // th, r % th, q // tw4, q % tw4
        tile = tc * ntr + tr if self.arrangement == "columns" else tr * ntc + tc
        gx, gy = tile % self.tiles_per_row, tile // self.tiles_per_row
        if self.packing == "strip":
            return gx * th * tw4 + ir * tw4 + iq, gy
        return gx * tw4 + iq, gy * th + ir

    def c_coord(self, texel: str) -> str:
        """OpenCL C int2 of the texel index expression `texel` (a byte index under a mask kind; every
        other figure a literal)."""
        if self.kind == "flat" or self.kind in MASK_ELEMENTS:
            if self.height == 1:  # one image row: the index is the column, no division
                return f"(int2)({texel}, 0)"
            if self.width & (self.width - 1) == 0:  # a power of two: shift and mask
                return f"TEXEL_P2({texel}, {self.width.bit_length() - 1})"
            return f"(int2)({mod_index(f'({texel})', self.width)}, {div_index(f'({texel})', self.width)})"
        return f"{self.c_function}({texel})"

    @property
    def c_function(self) -> str:
        """Name of the OpenCL C function placing an R-Tile layout's texels (`c_definition`), from its figures."""
        ntr, ntc = self.tile_grid
        figures = (self.cols // 4, self.tile_h, self.tile_texels_w, ntr, ntc, self.tiles_per_row)
        return "_".join(["RTILE", *map(str, figures), self.packing, self.arrangement])

    def c_definition(self) -> str:
        """The OpenCL C function `c_function` (coords in C), its figures literals: each division a
        shift or a multiply by a constant (div_index), each remainder a multiply-subtract."""
        c4, th, tw4, tpr = self.cols // 4, self.tile_h, self.tile_texels_w, self.tiles_per_row
        ntr, ntc = self.tile_grid
        tile = f"tc * {ntr}u + tr" if self.arrangement == "columns" else f"tr * {ntc}u + tc"
        place = (f"(int2)(gx * {th * tw4}u + ir * {tw4}u + iq, gy)" if self.packing == "strip"
                 else f"(int2)(gx * {tw4}u + iq, gy * {th}u + ir)")
        return "\n".join([
            f"inline __attribute__((always_inline)) int2 {self.c_function}(uint t) {{",
            f"  const uint r = {div_index('t', c4)}, q = t - r * {c4}u;",
            f"  const uint tr = {div_index('r', th)}, ir = r - tr * {th}u, tc = {div_index('q', tw4)}, "
            f"iq = q - tc * {tw4}u;",
            f"  const uint tile = {tile};",
            f"  const uint gy = {div_index('tile', tpr)}, gx = tile - gy * {tpr}u;",
            f"  return {place};",
            "}"])

    def describe(self) -> str:
        if self.kind in MASK_ELEMENTS:
            paired = f", bytes pair texels {self.mask_pair_stride} apart" if self.mask_pair_stride != 1 else ""
            return f"{self.kind} ({MASK_ELEMENTS[self.kind]} mask bits per byte{paired}); image {self.width}x{self.height}"
        if self.kind == "flat":
            return f"flat; image {self.width}x{self.height}"
        padding = self.width * self.height - self.rows * self.cols // 4
        return (f"rtile {self.tile_h}x{self.tile_w} {self.packing}, tiles by {self.arrangement}; matrix "
                f"{self.rows}x{self.cols}; image {self.width}x{self.height}, padding {padding} texels")

    # serialisation ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return _json_of(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TexelLayout:
        return cls(**data)


@lru_cache(maxsize=4096)
def _json_of(layout: TexelLayout) -> str:
    fields = {k: v for k, v in vars(layout).items() if k != "mask_pair_stride" or v != 1}  # unpaired: as before
    return json.dumps(fields, separators=(",", ":"))


def flat_layout(texels: int, max_width: int) -> TexelLayout:
    width = max(1, min(texels, max_width))
    return TexelLayout("flat", width, -(-texels // width))


def mask_layout(kind: str, count: int, max_width: int, max_height: int, pair_stride: int = 1) -> TexelLayout:
    """The image of a `count`-element boolean tensor under mask `kind`: its ceil(count / elements
    per byte) bytes laid flat (mask8 bytes pairing texels `pair_stride` apart: mask_bytes), in an
    image of exactly that size when a width divides it (so a mask costs its bits and nothing more),
    else in rows of `max_width`, the last padded."""
    if kind not in MASK_ELEMENTS:
        raise ValueError(f"unknown mask kind '{kind}'; one of: {', '.join(MASK_ELEMENTS)}")
    if pair_stride != 1 and kind != "mask8":
        raise ValueError(f"a {kind} byte holds one texel: it pairs none {pair_stride} apart")
    size = max(1, mask_bytes(kind, -(-count // 4), pair_stride))
    width = _dividing_width(size, max_width, max_height)
    return TexelLayout(kind, width, -(-size // width), mask_pair_stride=pair_stride)


def mask_bytes(kind: str, texels: int, pair_stride: int = 1) -> int:
    """Bytes of a mask of `texels` 4-element texels: one a texel (mask4), one a pair (mask8), the pairs of
    each run of 2 * pair_stride texels filling pair_stride bytes (a last partial run its own share)."""
    if kind == "mask4":
        return texels
    runs, rest = divmod(texels, 2 * pair_stride)
    return runs * pair_stride + min(rest, pair_stride)


def mask_byte_of(texels: np.ndarray, pair_stride: int) -> tuple[np.ndarray, np.ndarray]:
    """(byte, nibble) of mask8 texel indices `texels` (numpy): texel t is nibble (t / P) & 1 of byte
    (t / 2P) * P + t % P, P = pair_stride (P = 1: nibble t & 1 of byte t >> 1)."""
    t = np.asarray(texels, dtype=np.int64)
    return t // (2 * pair_stride) * pair_stride + t % pair_stride, (t // pair_stride) & 1


@lru_cache(maxsize=1024)
def _dividing_width(size: int, max_width: int, max_height: int) -> int:
    """The widest width in [max_width / NARROWEST, max_width] that divides `size` into at most
    max_height rows, else max_width (the last row padded): no sliver of an image, which would
    waste most of every cache block the readers fetch."""
    if size <= max_width:
        return size
    for width in range(max_width, max(max_width // NARROWEST, -(-size // max_height)) - 1, -1):
        if size % width == 0:
            return width
    return max_width


def matrix_layout(shape: tuple[int, ...], max_width: int, max_height: int) -> TexelLayout:
    """Flat addressing with one image row per matrix row (1 x cols tiles stacked), when the last axis
    is a multiple of 4 and fits: rows stay vertically adjacent, so a walk down a column reads
    2-D cache blocks, yet the image is still the linear array the runtimes exchange."""
    texels = max(1, -(-math.prod(shape) // 4))
    if len(shape) >= 2 and shape[-1] % 4 == 0 and 0 < shape[-1] // 4 <= max_width \
            and texels // (shape[-1] // 4) <= max_height:
        return TexelLayout("flat", shape[-1] // 4, texels // (shape[-1] // 4))
    return flat_layout(texels, max_width)


def rtile_layout(rows: int, cols: int, tile_h: int, tile_w: int, packing: str, max_width: int) -> TexelLayout:
    """The R-Tile layout of a [rows, cols] matrix with the given tile, arranged as section 6 says."""
    probe = TexelLayout("rtile", 1, 1, rows, cols, tile_h, tile_w, packing)
    ntr, ntc = probe.tile_grid
    arrangement = "columns" if ntr > ntc else "rows"
    tile_width, tile_height = probe.tile_footprint
    tiles_per_row = max(1, min(max(ntr, ntc), max_width // tile_width))
    tiles = ntr * ntc
    return TexelLayout("rtile", tiles_per_row * tile_width, -(-tiles // tiles_per_row) * tile_height, rows, cols,
                       tile_h, tile_w, packing, arrangement, tiles_per_row)


@lru_cache(maxsize=256)
def _positions(layout: TexelLayout, texels: int) -> np.ndarray:
    x, y = layout.coords(np.arange(texels))
    return y * layout.width + x


def pack(array: np.ndarray, layout: TexelLayout, dtype: Any) -> np.ndarray:
    """`array` as its image's RGBA texels, row by row (height * width * 4 values, zero padding)."""
    values = np.asarray(array).reshape(-1)
    texels = -(-values.size // 4)
    if layout.kind in MASK_ELEMENTS and layout.mask_pair_stride != 1:  # nibbles of bytes pairing texels P apart
        bits = np.zeros(texels * 4, dtype=np.uint8)
        bits[: values.size] = values != 0
        nibbles = (bits.reshape(-1, 4) << np.arange(4, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
        byte, nibble = mask_byte_of(np.arange(texels), layout.mask_pair_stride)
        image = np.zeros(layout.width * layout.height, dtype=np.uint8)
        np.bitwise_or.at(image, byte, (nibbles << (4 * nibble)).astype(np.uint8))
        return image.astype(dtype)
    if layout.kind in MASK_ELEMENTS:
        per_byte = MASK_ELEMENTS[layout.kind]
        bits = np.zeros(-(-values.size // per_byte) * per_byte, dtype=np.uint8)
        bits[: values.size] = values != 0
        image = np.zeros(layout.width * layout.height, dtype=np.uint8)
        image[: bits.size // per_byte] = (bits.reshape(-1, per_byte) << np.arange(per_byte, dtype=np.uint8)).sum(
            axis=1, dtype=np.uint8)  # LSB first
        return image.astype(dtype)
    logical = np.zeros(texels * 4, dtype=dtype)
    with np.errstate(over="ignore"):  # fp16: float32's -3.4e38 mask fill becomes -inf, which softmax reads the same
        logical[: values.size] = values.astype(dtype)
    if layout.kind == "flat":
        image = np.zeros(layout.width * layout.height * 4, dtype=dtype)
        image[: logical.size] = logical
        return image
    image = np.zeros((layout.width * layout.height, 4), dtype=dtype)
    image[_positions(layout, texels)] = logical.reshape(-1, 4)
    return image.reshape(-1)


def unpack(image: np.ndarray, layout: TexelLayout, count: int) -> np.ndarray:
    """The first `count` elements, row-major, of an image packed by `pack`."""
    flat = np.asarray(image).reshape(-1)
    if layout.kind in MASK_ELEMENTS and layout.mask_pair_stride != 1:
        byte, nibble = mask_byte_of(np.arange(-(-count // 4)), layout.mask_pair_stride)
        nibbles = (flat.astype(np.uint8)[byte] >> (4 * nibble).astype(np.uint8)) & 15
        return ((nibbles[:, None] >> np.arange(4, dtype=np.uint8)) & 1).reshape(-1)[:count]
    if layout.kind in MASK_ELEMENTS:
        per_byte = MASK_ELEMENTS[layout.kind]
        data = flat[: -(-count // per_byte)].astype(np.uint8)
        return ((data[:, None] >> np.arange(per_byte, dtype=np.uint8)) & 1).reshape(-1)[:count]
    if layout.kind == "flat":
        return flat[:count]
    texels = -(-count // 4)
    return flat.reshape(-1, 4)[_positions(layout, texels)].reshape(-1)[:count]
