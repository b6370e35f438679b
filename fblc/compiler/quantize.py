"""Group-wise weight quantization: what --weights int4|int8 stores in place of a frozen float weight.

A weight W is cut into groups of `group` consecutive elements along its reduction axis (ONNX
DequantizeLinear's blocked form, opset 21: `axis` the reduction axis, `block_size` the group);
each group gets one scale s = max|w| / qmax, rounded to fp16 (the scale's storage), and
q = clip(round(w / s), qmin, qmax) (symmetric, signed: no zero point). deq(q) = q * s is what
the step computes with, and what FuRA-S's block SVD takes (fblc.compiler.fura_s).

On the device the integers are packed: element i of the tensor is bits [b*(i % n), b*(i % n + 1))
of 32-bit word i // n (n = 32 / b, little-endian, two's complement), four words a texel
(pack_words; the dequantizing read is fblc.codegen.reads.ValueReads.element).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from fblc.errors import FblcError

#: --weights: the frozen weights' storage; "fp32" keeps them as they are
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
DEFAULT_GROUP = 32


@dataclass(frozen=True)
class IntFormat:
    bits: int
    signed: bool
    dtype: ir.DataType
    numpy: type


#: ONNX integer types a DequantizeLinear may read, and how their elements pack
INT_FORMATS: dict[ir.DataType, IntFormat] = {
    ir.DataType.INT8: IntFormat(8, True, ir.DataType.INT8, np.int8),
    ir.DataType.UINT8: IntFormat(8, False, ir.DataType.UINT8, np.uint8),
    ir.DataType.INT4: IntFormat(4, True, ir.DataType.INT4, ml_dtypes.int4),
    ir.DataType.UINT4: IntFormat(4, False, ir.DataType.UINT4, ml_dtypes.uint4),
}
#: --weights -> the signed integer type that stores it
STORED_AS = {"int8": ir.DataType.INT8, "int4": ir.DataType.INT4}


@dataclass(frozen=True)
class WeightFormat:
    """--weights and --weight-group."""

    weights: str = "fp32"
    group: int = DEFAULT_GROUP

    def validate(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise FblcError(f"unknown --weights '{self.weights}'", f"choose one of: {', '.join(WEIGHT_FORMATS)}")
        if self.group < 1:
            raise FblcError(f"--weight-group {self.group} is not a positive group size",
                            f"use a power of two such as {DEFAULT_GROUP}")

    @property
    def quantized(self) -> bool:
        return self.weights in STORED_AS


def group_of(length: int, group: int) -> int:
    """The group size used along an axis of `length`: `group`, or the whole axis where it is shorter."""
    return min(group, length)


def quantize(w: np.ndarray, axis: int, group: int, dtype: ir.DataType) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) of `w` in signed `dtype` (INT8/INT4), groups of `group` along `axis`: q has w's shape
    (the type's numpy dtype), scale w's shape with that axis ceil(len / group) long (float32 values that
    fp16 holds exactly). A last, shorter group is allowed (DequantizeLinear's blocks may be ragged)."""
    form = INT_FORMATS[dtype]
    qmax = 2 ** (form.bits - 1) - 1
    w = np.asarray(w, np.float32)
    length = w.shape[axis]
    blocks = -(-length // group)
    padded = np.pad(np.moveaxis(w, axis, -1), [(0, 0)] * (w.ndim - 1) + [(0, blocks * group - length)])
    grouped = padded.reshape(padded.shape[:-1] + (blocks, group))
    peak = np.abs(grouped).max(axis=-1)
    scale = (peak / qmax).astype(np.float16).astype(np.float32)
    scale[scale == 0] = 1.0  # an all-zero group: any scale gives q = 0
    q = np.clip(np.rint(grouped / scale[..., None]), -qmax - 1, qmax)
    q = q.reshape(padded.shape)[..., :length]
    return np.moveaxis(q, -1, axis).astype(form.numpy), np.moveaxis(scale, -1, axis)


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, axis: int, group: int) -> np.ndarray:
    """ONNX DequantizeLinear (blocked along `axis`, or per axis / per tensor by the scale's rank) in float32."""
    values = np.asarray(q).astype(np.float32)
    scale = np.asarray(scale, np.float32)
    zero = np.zeros_like(scale) if zero_point is None else np.asarray(zero_point).astype(np.float32)
    if scale.ndim == values.ndim and values.ndim > 0:  # blocked
        axis %= values.ndim
        scale = np.repeat(scale, group, axis=axis).take(range(values.shape[axis]), axis=axis)
        zero = np.repeat(zero, group, axis=axis).take(range(values.shape[axis]), axis=axis)
    elif scale.ndim == 1:  # per axis
        axis %= values.ndim
        view = [1] * values.ndim
        view[axis] = -1
        scale, zero = scale.reshape(view), zero.reshape(view)
    return (values - zero) * scale


#: elements of a weight quantize_sliced works on at once
SLICE_ELEMENTS = 1 << 22


def quantize_sliced(w: np.ndarray, axis: int, group: int, dtype: ir.DataType, slice_elements: int = SLICE_ELEMENTS
                    ) -> tuple[np.ndarray, np.ndarray, float]:
    """quantize() of a 2-D `w` and the relative Frobenius error of its dequantized values, computed slice by
    slice along the axis not reduced (groups never cross it): the same q and scale, with temporaries of one slice.
    Whole, a Llama-3.2-1B LM head (1 GB of fp32, possibly memory-mapped) took ~6 GB of temporaries."""
    other = 1 - axis
    step = max(1, slice_elements // max(w.shape[axis], 1))
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    total = difference = 0.0
    for start in range(0, w.shape[other], step):
        index = [slice(None), slice(None)]
        index[other] = slice(start, start + step)
        piece = np.asarray(w[tuple(index)], np.float32)
        q, scale = quantize(piece, axis, group, dtype)
        total += float(np.square(piece, dtype=np.float64).sum())
        difference += float(np.square(piece.astype(np.float64) - dequantize(q, scale, None, axis, group)).sum())
        pieces.append((q, scale))
    q = np.concatenate([q for q, _ in pieces], axis=other)
    scale = np.concatenate([scale for _, scale in pieces], axis=other)
    return q, scale, float(np.sqrt(difference / total)) if total else 0.0


def relative_error(w: np.ndarray, approx: np.ndarray) -> float:
    """||W - approx||_F / ||W||_F (0 for an all-zero W)."""
    norm = float(np.linalg.norm(np.asarray(w, np.float64)))
    return float(np.linalg.norm(np.asarray(w, np.float64) - approx)) / norm if norm else 0.0


def pack_words(q: np.ndarray, bits: int) -> np.ndarray:
    """The elements of `q` (any integer type, row-major) as packed little-endian uint32 words (see the module)."""
    per_word = 32 // bits
    raw = np.asarray(q).reshape(-1).astype(np.int64) & ((1 << bits) - 1)
    padded = np.zeros(-(-raw.size // per_word) * per_word, np.uint64)
    padded[: raw.size] = raw
    shifts = np.arange(per_word, dtype=np.uint64) * np.uint64(bits)
    return (padded.reshape(-1, per_word) << shifts).sum(axis=1, dtype=np.uint64).astype(np.uint32)


def packed_words(count: int, bits: int) -> int:
    """32-bit words that hold `count` packed elements of `bits` bits."""
    return -(-count * bits // 32)


def stored_values(w: np.ndarray, axis: int, weights: WeightFormat) -> np.ndarray:
    """The values the device computes with for frozen weight `w` (reduction axis `axis`) under `weights`:
    deq(q(w)) for int8/int4, w rounded to fp16 for fp16, w itself for fp32 (float32)."""
    w = np.asarray(w, np.float32)
    if weights.weights == "fp16":
        return w.astype(np.float16).astype(np.float32)
    if not weights.quantized:
        return w
    group = group_of(w.shape[axis], weights.group)
    q, scale = quantize(w, axis, group, STORED_AS[weights.weights])
    return dequantize(q, scale, None, axis, group)
