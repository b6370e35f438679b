"""Reading constant tensors' data in bounded pieces, for the passes and the params.bin writer.

A model's external data (model_io.load_model) stays memory-mapped by onnx_ir: nothing is read until a
tensor's numpy() is, and then only the pages touched. Those pages count in the process's memory (RSS)
for as long as the mapping holds them, so a reader that walks a whole 6 GB model would end up holding
it all. `MappedConstant` hands the pages a piece touched back to the kernel (MADV_DONTNEED; they stay in
the page cache, shared and reclaimable) before the next piece, and unmaps the file when done: a walk
over the weights holds one piece at a time. In-memory tensors (inline initializers, Constant nodes,
lazily made optimizer state) are read as they are.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Iterator

import numpy as np
import onnx_ir as ir

#: bytes of source data one piece of a walk touches (and so at most holds)
PIECE_BYTES = 16 << 20


def constant_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """The tensor behind an initializer or a Constant node's output, without reading its data; else None."""
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        attr = producer.attributes.get("value")
        if attr is not None:
            return attr.as_tensor()
    return None


class MappedConstant:
    """A constant's data (a view of its memory mapping where it is external); `drop()` hands back the pages
    read so far, `close()` unmaps. Use as a context manager."""

    def __init__(self, tensor: ir.TensorProtocol) -> None:
        self.tensor = tensor
        self.array: np.ndarray = tensor.numpy()

    def drop(self) -> None:
        """Hand the pages of the mapping read so far back to the kernel (a no-op for in-memory data)."""
        raw = getattr(self.tensor, "raw", None)
        if not isinstance(self.tensor, ir.ExternalTensor) or raw is None or raw.closed:
            return
        start = (self.tensor.offset or 0) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(raw), (self.tensor.offset or 0) + self.tensor.nbytes)
        if end > start:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self.drop()
        del self.array
        if isinstance(self.tensor, ir.ExternalTensor):
            try:
                self.tensor.release()  # unmapped; the next numpy() maps it again
            except BufferError:  # a caller still holds a view of it: its pages were dropped, the mapping stays
                pass

    def __enter__(self) -> MappedConstant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HalfRounded:
    """A float weight's values rounded to fp16 (as float32): --weights fp16's weight (passes/quantize_weights.py),
    an ir.LazyTensor's function, so that no rounded copy is held. `source` is the weight as read: stored as half,
    its pieces give the same bytes (fp16 rounding rounds a rounded value to itself), which the params.bin writer
    packs from (codegen/params.py) without making the rounded copy at all."""

    def __init__(self, source: ir.TensorProtocol) -> None:
        self.source = source

    def __call__(self) -> ir.TensorProtocol:
        with MappedConstant(self.source) as mapped:
            return ir.tensor(np.asarray(mapped.array, np.float32).astype(np.float16).astype(np.float32))


def rows_per_piece(array: np.ndarray, budget: int = PIECE_BYTES) -> int:
    """How many leading-axis rows of `array` fit `budget` bytes (at least one)."""
    row = array.nbytes // max(1, array.shape[0]) if array.ndim else array.nbytes
    return max(1, budget // max(1, row))


def flat_pieces(mapped: MappedConstant, budget: int = PIECE_BYTES) -> Iterator[np.ndarray]:
    """The constant's elements, row-major, as consecutive 1-D slices of at most `budget` bytes, the pages of
    each dropped before the next is read."""
    values = mapped.array.reshape(-1)
    step = max(1, budget // max(1, values.itemsize))
    for start in range(0, values.size, step):
        yield values[start:start + step]
        mapped.drop()


def is_hole(tensor: ir.TensorProtocol) -> bool:
    """Whether the tensor is external data lying wholly in a hole of a sparse file (all zeros, as the
    filesystem reads a hole), found by lseek(SEEK_DATA) without reading it."""
    if not isinstance(tensor, ir.ExternalTensor) or tensor.nbytes == 0 or not hasattr(os, "SEEK_DATA"):
        return False
    start = tensor.offset or 0
    try:
        with open(tensor.path, "rb") as handle:
            return os.lseek(handle.fileno(), start, os.SEEK_DATA) >= start + tensor.nbytes
    except OSError as error:  # ENXIO: no data past `start`; EINVAL etc.: the filesystem cannot say
        return error.errno == errno.ENXIO


SAMPLES = 61  # elements a fingerprint reads


def fingerprint(tensor: ir.TensorProtocol) -> bytes:
    """A few elements at fixed places, equal for a 1-D or 2-D tensor and its transpose (so for any two
    tensors that are equal, plain or transposed): reads SAMPLES elements, not the tensor."""
    with MappedConstant(tensor) as mapped:
        array = mapped.array
        if array.ndim == 2:
            oriented = array if array.shape[0] <= array.shape[1] else array.T
            rows, cols = oriented.shape
            k = np.arange(SAMPLES)
            i, j = k * 7919 % rows, k * 104729 % cols
            if rows == cols:  # a square matrix and its transpose: the pair (V[i, j], V[j, i]) in sorted order
                picked = np.sort(np.stack([oriented[i, j], oriented[j, i]]), axis=0)
            else:
                picked = oriented[i, j]
        else:
            flat = array.reshape(-1)
            picked = flat[np.arange(SAMPLES) * 7919 % max(1, flat.size)] if flat.size else flat
        return np.ascontiguousarray(picked + np.zeros((), picked.dtype)).tobytes()  # -0.0 as 0.0: equal values


def value_range(tensor: ir.TensorProtocol) -> tuple[float, float]:
    """(min, max) of a float tensor, read piece by piece; NaN where it holds a NaN (as numpy's min and max)."""
    if is_hole(tensor):
        return 0.0, 0.0
    low, high = np.inf, -np.inf
    with MappedConstant(tensor) as mapped:
        for piece in flat_pieces(mapped):
            low, high = np.minimum(low, piece.min()).item(), np.maximum(high, piece.max()).item()
    return low, high


def equal_data(first: ir.TensorProtocol, second: ir.TensorProtocol, transposed: bool) -> bool:
    """Whether `second` is `first` (or, `transposed`, the 2-D `first`'s transpose) bit for bit, compared in
    blocks of bounded size."""
    with MappedConstant(first) as a, MappedConstant(second) as b:
        x, y = a.array, b.array
        if (x.shape[::-1] if transposed else x.shape) != y.shape:
            return False
        if not transposed:
            x, y = x.reshape(-1), y.reshape(-1)
            step = max(1, PIECE_BYTES // max(1, x.itemsize))
            for start in range(0, x.size, step):
                if not np.array_equal(x[start:start + step], y[start:start + step]):
                    return False
                a.drop(), b.drop()
            return True
        side = max(1, int((PIECE_BYTES // max(1, x.itemsize)) ** 0.5))  # square blocks: both reads bounded
        for i in range(0, y.shape[0], side):
            for j in range(0, y.shape[1], side):
                if not np.array_equal(y[i:i + side, j:j + side], x[j:j + side, i:i + side].T):
                    return False
                a.drop()
            b.drop()
        return True
