"""params.bin: each texture's initial contents, packed into its layout and written through a bounded buffer.

`lower` records what a texture starts with as `TextureContents` (an object that gives its bytes piece by
piece), never the packed array: a 1B-parameter model's weights are never whole in host memory. The
writer asks each texture in turn for its bytes (`pieces`), so whatever makes them (a constant packed into
its texel layout here; a quantizer's packed codes elsewhere) plugs in with the same two members.

`PackedConstant` packs a constant the way texel_layout.pack does, byte for byte, without its copies:
a flat layout is the elements in order then zeros; an R-Tile layout is written by windows of whole image
rows, each texel of a window gathered from the source texel that texel_layout.coords places there (the
inverse of coords, computed per window). The source is read through weight_data.MappedConstant, whose
pages are handed back after each window where the windows walk the source in order.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import onnx_ir as ir

from fblc.compiler.quantize import pack_words
from fblc.compiler.weight_data import PIECE_BYTES, HalfRounded, MappedConstant, constant_tensor, flat_pieces
from fblc.texel_layout import MASK_ELEMENTS, TexelLayout, pack

ALIGN = 64  # bytes; every texture's initial data starts on this boundary in params.bin


class TextureContents(Protocol):
    """A texture's initial contents: `nbytes` in all, given as consecutive pieces (each bounded in size)."""

    @property
    def nbytes(self) -> int: ...

    def pieces(self) -> Iterator[np.ndarray]: ...


def image_elements(layout: TexelLayout) -> int:
    """Elements of the packed image (texel_layout.pack's length): bytes of a mask, 4 a texel otherwise."""
    return layout.width * layout.height * (1 if layout.kind in MASK_ELEMENTS else 4)


@dataclass(frozen=True)
class PackedConstant:
    """The constant `value` (an initializer or a Constant's output) packed into `layout` as `dtype`."""

    value: ir.Value
    layout: TexelLayout
    dtype: np.dtype
    #: int4/int8 elements packed 8 or 4 to a 32-bit word (Texture.packed_bits; 0: stored as they are)
    packed_bits: int = 0

    @property
    def nbytes(self) -> int:
        return image_elements(self.layout) * self.dtype.itemsize

    def array(self) -> np.ndarray:
        """The whole packed image (texel_layout.pack), for small contents and tests."""
        return np.concatenate([np.zeros(0, self.dtype), *(piece.reshape(-1) for piece in self.pieces())])

    def pieces(self, budget: int = PIECE_BYTES) -> Iterator[np.ndarray]:
        tensor = constant_tensor(self.value)
        if tensor is None:
            raise AssertionError(f"'{self.value.name}' has no constant contents to pack")
        rounded = getattr(tensor, "raw", None)
        if isinstance(rounded, HalfRounded) and self.dtype == np.float16:  # the source's pieces as half: the same
            tensor = rounded.source
        with MappedConstant(tensor) as mapped:
            if self.packed_bits:  # a quantized weight: its words (a flat layout), a piece at a time
                yield from self._words(mapped, budget)
            elif self.layout.kind in MASK_ELEMENTS or self.nbytes <= budget:  # small, or bits: pack whole
                yield pack(mapped.array, self.layout, self.dtype)
            elif self.layout.kind == "flat":
                yield from self._flat(mapped, budget)
            else:
                yield from self._rtile(mapped, budget)

    def _flat(self, mapped: MappedConstant, budget: int) -> Iterator[np.ndarray]:
        written = 0
        with np.errstate(over="ignore"):  # fp16: float32's -3.4e38 mask fill becomes -inf, as pack makes it
            for piece in flat_pieces(mapped, budget):
                yield piece.astype(self.dtype, copy=False)  # the mapping's own bytes where the format is theirs
                written += piece.size
        total = image_elements(self.layout)
        step = max(1, budget // self.dtype.itemsize)
        for start in range(written, total, step):  # the last texel's and rows' padding
            yield np.zeros(min(step, total - start), self.dtype)

    def _words(self, mapped: MappedConstant, budget: int) -> Iterator[np.ndarray]:
        """pack(pack_words(q), layout): the packed words in order, then zeros; each piece of whole words packs
        the elements it covers alone."""
        if self.layout.kind != "flat":
            raise AssertionError(f"'{self.value.name}' is packed {self.packed_bits}-bit words in a {self.layout.kind} "
                                 "layout: packed textures are flat (codegen/textures.py)")
        per_word = 32 // self.packed_bits
        values = mapped.array.reshape(-1)
        step = max(1, budget // 4) * per_word
        written = 0
        for start in range(0, values.size, step):
            words = pack_words(values[start:start + step], self.packed_bits).view(np.int32).astype(self.dtype, copy=False)
            written += words.size
            yield words
        total = image_elements(self.layout)
        for start in range(written, total, max(1, budget // self.dtype.itemsize)):
            yield np.zeros(min(max(1, budget // self.dtype.itemsize), total - start), self.dtype)

    def _rtile(self, mapped: MappedConstant, budget: int) -> Iterator[np.ndarray]:
        layout = self.layout
        texels = mapped.array.reshape(-1, 4)  # R-Tile: the last axis is a multiple of 4, whole texels
        whole = np.ascontiguousarray(texels).view(np.dtype((np.void, 4 * texels.itemsize))).reshape(-1)
        rows_at_once = max(1, budget // (layout.width * 4 * self.dtype.itemsize))
        in_order = layout.arrangement == "rows"  # windows walk the source rows in order: drop as we go
        with np.errstate(over="ignore"):
            for y0 in range(0, layout.height, rows_at_once):
                y1 = min(layout.height, y0 + rows_at_once)
                source = source_texels(layout, y0, y1)
                placed = source >= 0
                if placed.all():  # no padding here: gather whole texels (one 4-element item each), then convert
                    yield whole.take(source).view(texels.dtype).astype(self.dtype, copy=False)
                else:
                    window = np.zeros(((y1 - y0) * layout.width, 4), self.dtype)
                    window[placed] = texels[source[placed]].astype(self.dtype)
                    yield window.reshape(-1)
                if in_order:
                    mapped.drop()


def source_texels(layout: TexelLayout, y0: int, y1: int) -> np.ndarray:
    """For each texel of image rows [y0, y1) of an R-Tile `layout`, row-major, the source texel that
    layout.coords places there, or -1 for padding: coords inverted. Computed as a tile's base (per image row
    and tile slot) plus the texel's place in its tile (the same in every tile), broadcast once."""
    tw4, th = layout.tile_texels_w, layout.tile_h
    ntr, ntc = layout.tile_grid
    c4 = layout.cols // 4
    y = np.arange(y0, y1, dtype=np.int64)[:, None, None]  # [rows, tile slots, texels of a slot]
    if layout.packing == "strip":  # a whole tile on one image row, its rows one after another
        span = th * tw4
        inside = np.arange(span, dtype=np.int64)[None, None, :]
        gy, ir_, iq = y, inside // tw4, inside % tw4
    else:  # a tile over th image rows, tw4 texels wide
        span = tw4
        gy, ir_, iq = y // th, y % th, np.arange(tw4, dtype=np.int64)[None, None, :]
    gx = np.arange(-(-layout.width // span), dtype=np.int64)[None, :, None]
    tile = gy * layout.tiles_per_row + gx
    if layout.arrangement == "columns":
        tc, tr = np.divmod(tile, ntr)
    else:
        tr, tc = np.divmod(tile, ntc)
    index = (tr * th * c4 + tc * tw4) + (ir_ * c4 + iq)
    placed = (gx < layout.tiles_per_row) & (tile < ntr * ntc)
    if layout.rows % th or c4 % tw4:  # partial tiles at the matrix's edges: their rows / texels beyond it
        placed = placed & (tr * th + ir_ < layout.rows) & (tc * tw4 + iq < c4)
    index = np.where(placed, index, -1)
    rows = y1 - y0
    return np.broadcast_to(index, (rows, gx.shape[1], span)).reshape(rows, -1)[:, :layout.width].reshape(-1)


def params_offsets(contents: dict[int, TextureContents]) -> dict[int, tuple[int, int]]:
    """texture id -> (offset, nbytes) in params.bin: in id order, each start aligned to ALIGN."""
    offsets: dict[int, tuple[int, int]] = {}
    end = 0
    for texture_id, content in sorted(contents.items()):
        end += -end % ALIGN
        offsets[texture_id] = (end, content.nbytes)
        end += content.nbytes
    return offsets


#: params.bin's writer (ParamsFile.write_to) copies the pieces into blocks of this many bytes and writes each with
#: O_DIRECT: the tied-head 1B model's 4.9 GB written through the page cache took 11.7 CPU s (5.2 so), most of it
#: the kernel's copying, on a loaded 2-core machine (dd there: 5.7 sys s per 2.5 GB buffered, 0.4 with oflag=direct)
DIRECT_BLOCK = 16 << 20
DIRECT_ALIGN = 4096  # O_DIRECT's alignment of buffers, file offsets and lengths (a page; logical blocks are smaller)


@dataclass
class ParamsFile:
    """params.bin to be written: each texture's contents at its offset (params_offsets)."""

    contents: dict[int, TextureContents]

    @property
    def offsets(self) -> dict[int, tuple[int, int]]:
        return params_offsets(self.contents)

    def chunks(self) -> Iterator[memoryview]:
        """The file's bytes in order: each texture's pieces after the zeros that align it. A piece may be a view of
        a weight's memory mapping, valid until the next is asked for (its pages are dropped then)."""
        written = 0
        for texture_id, (offset, nbytes) in sorted(self.offsets.items()):
            yield memoryview(bytes(offset - written))
            written = offset
            for piece in self.contents[texture_id].pieces():
                data = memoryview(np.ascontiguousarray(piece)).cast("B")
                written += len(data)
                yield data
            if written - offset != nbytes:
                raise AssertionError(f"texture {texture_id}'s contents gave {written - offset} bytes, not {nbytes}")

    def write_to(self, path: str, block: int = DIRECT_BLOCK) -> str:
        """Write the file to `path` (made or truncated); returns its sha256 (hex). See DIRECT_BLOCK: the bytes are
        copied into two page-aligned blocks of `block` bytes; while this thread fills and hashes one, a second
        writes the other with O_DIRECT (past the page cache), or plainly where the filesystem refuses O_DIRECT
        (tmpfs, some network filesystems) or the platform has none."""
        if block <= 0 or block % DIRECT_ALIGN:
            raise ValueError(f"block {block} is not a positive multiple of {DIRECT_ALIGN}")
        digest = hashlib.sha256()
        sink = _BlockSink(path)
        blocks = [mmap.mmap(-1, block), mmap.mmap(-1, block)]  # anonymous maps: page-aligned, as O_DIRECT needs
        views = [memoryview(buffer) for buffer in blocks]
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="fblc-params") as writer:
                pending: Future[None] | None = None
                current, fill = 0, 0

                for data in self.chunks():
                    while len(data):
                        n = min(len(data), block - fill)
                        views[current][fill:fill + n] = data[:n]
                        digest.update(views[current][fill:fill + n])  # here, not on the writer: both threads busy
                        data, fill = data[n:], fill + n
                        if fill == block:
                            if pending is not None:
                                pending.result()
                            pending = writer.submit(sink.write, views[current])
                            current, fill = 1 - current, 0
                if pending is not None:
                    pending.result()
                sink.write(views[current][:fill])
            sink.close()
        finally:
            sink.abandon()
            for view, buffer in zip(views, blocks):
                try:
                    view.release()
                    buffer.close()
                except BufferError:  # a failed write's traceback still holds a slice: the map goes with it
                    pass
        return digest.hexdigest()


class _BlockSink:
    """A file written block by block with O_DIRECT where it can be: every write but the last is a whole number of
    DIRECT_ALIGN bytes at an aligned offset; the last is padded to one and the file cut back to its length."""

    def __init__(self, path: str) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o666)
        except OSError as error:
            if error.errno != errno.EINVAL or not self.direct:
                raise
            self.direct, self.fd = False, os.open(path, flags, 0o666)
        self.length = 0

    def write(self, data: memoryview) -> None:
        length = len(data)
        if self.direct and length % DIRECT_ALIGN:  # the last block: padded, the file cut back in close()
            data = memoryview(data.obj)[:length + -length % DIRECT_ALIGN]
        try:
            self._write_all(data)
        except OSError as error:  # O_DIRECT refused at the first write: the rest written plainly
            if error.errno != errno.EINVAL or not self.direct:
                raise
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            os.lseek(self.fd, self.length, os.SEEK_SET)
            self._write_all(data[:length])
        self.length += length

    def _write_all(self, data: memoryview) -> None:
        while len(data):
            data = data[os.write(self.fd, data):]

    def close(self) -> None:
        if self.direct:
            os.ftruncate(self.fd, self.length)
        os.close(self.fd)
        self.fd = -1

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
