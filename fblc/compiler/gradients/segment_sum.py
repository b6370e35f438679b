"""Race-free segment sums: the backward of every gather (Gather on any axis, GatherND).

A gather reads rows of a [P, D, Q] tensor: out[p, n] = x[p, rows[p, n]] for n < N, where a row
is a [Q] slice, P the leading (batch) extent and `rows` holds, per p (or once for all p), N row
numbers in [0, D). Its gradient is the segment sum

    dx[p, d] = sum over n with rows[p, n] == d of dy[p, n]        (dy: [P, N, Q], dx: [P, D, Q])

Repeated rows must add up, in an order that does not depend on how a runtime splits the work:
the step ONNX runs in onnxruntime as well as on the device. onnxruntime's ScatterND with
reduction "add" splits the updates over its threads with no synchronisation, so two threads
that add into one row lose updates (1.32 on the CPU, a [256, 2048] table with 256 updates over
8 rows: max abs errors up to 4 with 2 or 4 threads, in some runs, the others differing in the
last bits; exact with 1). The three forms emitted here are deterministic in both runtimes and have device kernels:

1. `Pad`, when the rows are a constant ascending run s, s+1, .., s+N-1 shared by every p (CLS
   pooling h[:, 0], a fused-QKV select, position embeddings): no row repeats, dy is copied.
2. A one-hot contraction, when the one-hot is small: H[p, d, n] = (rows[p, n] == d) as a float,
   dx = H @ dy (MatMul). onnxruntime's GEMM splits output blocks over its threads, not the
   reduction, so it sums in one order at any thread count (the same bits with 1, 2, 4 and 8
   threads, tests/test_gradient_gather.py checks it); on the device it is a tiled contraction.
3. `ScatterElements` with reduction "add" along axis 1, the rows broadcast over Q (an Expand,
   a view under rtile): onnxruntime runs it in one thread, in update order; the device kernel
   folds the updates of a target row in update order too (fblc/codegen/kernels/gather.py).
   ScatterElements wants indices no longer than the data along every axis, so with more updates
   than rows the zero table gets N rows and the sum is sliced back to D.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from fblc.compiler.graph import Emitter
from fblc.compiler.values import numel

#: the largest one-hot (elements) form 2 builds: 4 MiB in fp32; beyond it the O(N * Q) scatter wins
ONE_HOT_ELEMENTS = 1 << 20
#: the most multiply-adds form 2 may spend (P * D * N * Q): the contraction does D times the work
#: of the scatter, which only a small table amortises
ONE_HOT_MACS = 1 << 28


def wrap_rows(e: Emitter, indices: ir.Value, size: int) -> ir.Value:
    """`indices` with negative entries counted from the end of an axis of `size` (ONNX gathers allow both)."""
    zero, size_value = e.const(np.array(0, np.int64)), e.const(np.array(size, np.int64))
    return e.op("Where", e.op("Less", indices, zero), e.op("Add", indices, size_value), indices)


def tuple_rows(e: Emitter, indices: ir.Value, dims: Sequence[int]) -> ir.Value:
    """The row-major offset in `dims` of each k-tuple of `indices` [.., k] (each entry wrapped like
    ONNX's negative indices), as [.., 1]: the row a GatherND or ScatterND tuple picks."""
    offset: ir.Value | None = None
    for j, size in enumerate(dims):
        stride = numel(dims[j + 1:])
        part = wrap_rows(e, e.op("Slice", indices, e.ints([j]), e.ints([j + 1]), e.ints([-1])), size)
        part = part if stride == 1 else e.op("Mul", part, e.const(np.array(stride, np.int64)))
        offset = part if offset is None else e.op("Add", offset, part)  # Add: Sum takes no integers
    assert offset is not None, "a tuple of at least one index"
    return offset


def constant_rows(array: np.ndarray, size: int) -> np.ndarray:
    """A constant index array as int64 row numbers in [0, size)."""
    rows = np.asarray(array, dtype=np.int64)
    return np.where(rows < 0, rows + size, rows)


def segment_sum(e: Emitter, dy: ir.Value, rows: np.ndarray | ir.Value, depth: int, like: ir.Value) -> ir.Value:
    """dx [P, depth, Q] from dy [P, N, Q] and rows [1 or P, N] (int64, in range): see the module docstring."""
    p, n, q = (int(d) for d in dy.shape)
    if isinstance(rows, np.ndarray) and (rows == rows[:1]).all():
        rows = rows[:1]  # per-p constant rows that agree: one shared set (a smaller one-hot, maybe a Pad)
    shared = int(rows.shape[0]) == 1
    if n == 0:
        return e.zeros([p, depth, q], like=like)
    if isinstance(rows, np.ndarray) and shared and _is_run(rows[0]):
        start = int(rows[0, 0])
        if start == 0 and n == depth:
            return dy
        return e.op("Pad", dy, e.ints([0, start, 0, 0, depth - start - n, 0]))
    if (1 if shared else p) * depth * n <= ONE_HOT_ELEMENTS and p * depth * n * q <= ONE_HOT_MACS:
        return _one_hot_sum(e, dy, rows, depth, like)
    return _scatter_sum(e, dy, rows, depth, like)


def _is_run(row: np.ndarray) -> bool:
    return bool((np.diff(row) == 1).all())


def _as_value(e: Emitter, rows: np.ndarray | ir.Value) -> ir.Value:
    return e.const(rows) if isinstance(rows, np.ndarray) else rows


def _one_hot_sum(e: Emitter, dy: ir.Value, rows: np.ndarray | ir.Value, depth: int, like: ir.Value) -> ir.Value:
    """Form 2: Cast(Equal(d, rows)) @ dy; H is [depth, N] when the rows are shared, else [P, depth, N]."""
    p, n, q = (int(d) for d in dy.shape)
    shared = int(rows.shape[0]) == 1
    # Computed from the rows even when they are constant: a one-hot initializer would be stored
    # in the model file and the bundle, while the Equal costs one elementwise kernel per step.
    if shared:
        targets, picked = np.arange(depth, dtype=np.int64).reshape(depth, 1), e.reshape(_as_value(e, rows), [1, n])
    else:
        targets, picked = np.arange(depth, dtype=np.int64).reshape(1, depth, 1), e.reshape(_as_value(e, rows),
                                                                                           [p, 1, n])
    one_hot = e.op("Cast", e.op("Equal", e.const(targets), picked), to=like.dtype)
    if shared and p == 1:  # a plain 2-D product: [depth, N] @ [N, Q]
        return e.reshape(e.op("MatMul", one_hot, e.reshape(dy, [n, q])), [1, depth, q])
    return e.op("MatMul", one_hot, dy)


def _scatter_sum(e: Emitter, dy: ir.Value, rows: np.ndarray | ir.Value, depth: int, like: ir.Value) -> ir.Value:
    """Form 3: ScatterElements(zeros, Expand(rows), dy, axis=1, reduction="add"), sliced to `depth` rows."""
    p, n, q = (int(d) for d in dy.shape)
    shared = int(rows.shape[0]) == 1
    index = e.reshape(_as_value(e, rows), [1 if shared else p, n, 1])
    index = e.op("Expand", index, e.ints([p, n, q]))
    height = max(depth, n)
    summed = e.op("ScatterElements", e.zeros([p, height, q], like=like), index, dy, axis=1, reduction="add")
    if height == depth:
        return summed
    return e.op("Slice", summed, e.ints([0]), e.ints([depth]), e.ints([1]))
