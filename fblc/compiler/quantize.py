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
    q, scale, _ = _quantize(w, axis, group, dtype, False)
    return q, scale


def quantize_with_error(w: np.ndarray, axis: int, group: int, dtype: ir.DataType
                        ) -> tuple[np.ndarray, np.ndarray, tuple[float, float]]:
    """quantize(w, ...) and (||W||^2, ||W - deq(q)||^2) summed in float64, from the same pass over `w`."""
    q, scale, sums = _quantize(w, axis, group, dtype, True)
    assert sums is not None
    return q, scale, sums


def _quantize(w: np.ndarray, axis: int, group: int, dtype: ir.DataType, with_error: bool
              ) -> tuple[np.ndarray, np.ndarray, tuple[float, float] | None]:
    form = INT_FORMATS[dtype]
    qmax = 2 ** (form.bits - 1) - 1
    w = np.asarray(w, np.float32)
    axis %= w.ndim
    length = w.shape[axis]
    blocks = -(-length // group)
    if length % group:  # a last, shorter group: padded with zeros, the groups along the last axis
        padded = np.pad(np.moveaxis(w, axis, -1), [(0, 0)] * (w.ndim - 1) + [(0, blocks * group - length)])
        grouped, inner = padded.reshape(padded.shape[:-1] + (blocks, group)), w.ndim
    else:  # whole groups: split the axis in place (no transposed copy), the group's elements on axis + 1
        grouped, inner = w.reshape(w.shape[:axis] + (blocks, group) + w.shape[axis + 1:]), axis + 1
    magnitude = np.abs(grouped)  # one pass and one reduction (max and -min along a short axis: two slow ones)
    peak = magnitude.max(axis=inner)
    scale = (peak / qmax).astype(np.float16).astype(np.float32)
    scale[scale == 0] = 1.0  # an all-zero group: any scale gives q = 0
    spread = np.expand_dims(scale, inner)
    levels = np.divide(grouped, spread)
    np.rint(levels, out=levels)
    np.clip(levels, -qmax - 1, qmax, out=levels)
    sums = None
    if with_error:  # deq(q) = q * scale (dequantize's float32 product, exact: a 4-8 bit q times an fp16 scale);
        # w - deq(q) is exact in float32 too (q = 0: w itself; else |w - q s| <= s / 2 <= |q s| / 2 puts w within a
        # factor 2 of q s: Sterbenz), so only the squares and sums need float64
        difference = np.multiply(levels, spread, out=magnitude)
        np.subtract(grouped, difference, out=difference)
        sums = float(np.square(grouped, dtype=np.float64).sum()), float(np.square(difference, dtype=np.float64).sum())
    # float -> int8 -> the stored type: ml_dtypes' int4 converts from float slowly; the values are in range
    q = levels.astype(np.int8 if form.signed else np.uint8).astype(form.numpy, copy=False)
    if length % group:
        q = np.moveaxis(q.reshape(padded.shape)[..., :length], -1, axis)
        scale = np.moveaxis(scale, -1, axis)
    else:
        q = q.reshape(w.shape)
    return q, scale, sums


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


def relative_error(w: np.ndarray, approx: np.ndarray) -> float:
    """||W - approx||_F / ||W||_F (0 for an all-zero W)."""
    norm = float(np.linalg.norm(np.asarray(w, np.float64)))
    return float(np.linalg.norm(np.asarray(w, np.float64) - approx)) / norm if norm else 0.0


def pack_words(q: np.ndarray, bits: int) -> np.ndarray:
    """The elements of `q` (any integer type, row-major) as packed little-endian uint32 words (see the module)."""
    values = np.asarray(q).reshape(-1)
    if bits in (4, 8) and values.dtype.itemsize == 1:  # int8/uint8, ml_dtypes' int4/uint4: an element a byte,
        data = values.view(np.uint8)  # two's complement (int4: its low nibble): the words' bytes, or nibbles of them
        if bits == 4:
            data = data & 15
            if data.size % 2:
                data = np.append(data, np.uint8(0))
            data = data[0::2] | (data[1::2] << 4)
        whole = np.zeros(-(-data.size // 4) * 4, np.uint8)
        whole[: data.size] = data
        return whole.view("<u4").astype(np.uint32, copy=False)
    per_word = 32 // bits
    raw = values.astype(np.int64) & ((1 << bits) - 1)
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
