"""lower_dft: rewrite DFT and STFT into a MatMul (a Conv for STFT) by a constant cosine/sine matrix.

A DFT along one axis is a real-linear map of the (real, imaginary) pairs, so it is a MatMul by a
constant matrix; its gradient and kernels are then MatMul's, exact on every device, and the
gradient is the transpose of the same matrix (what torch's fft backward computes). The matrix
entries are cos/sin of 2 pi ((t k) mod n) / n, computed in float64 (multiples of pi/2 exactly
0, 1 or -1, so the imaginary parts of IRFFT's DC and Nyquist bins get exact zero weights, as
numpy's and torch's irfft ignore them) and stored in the input's dtype.

Rewrites (`DFT_LOWERINGS`; the result has the node's output name):

- DFT (opset 17: `axis` attribute, default 1; opset 20: `axis` input, default -2) of X
  [.., L (axis), .., c] with c = 1 (real) or 2 (complex), n = `dft_length` (a constant; default L,
  or 2 (L - 1) for IRFFT): Transpose the axis next to c (none when it is already there), Slice the
  L' positions the transform reads when L is longer (truncation; zero padding needs no rows),
  Reshape to [M, L' c],
  MatMul by W [L' c, K c_out], Reshape to [.., K, c_out], Transpose back. Forward: K = n, or
  n // 2 + 1 with `onesided` (RFFT: real input; onnx's shape inference, run first, refuses a
  complex one as the spec does); c_out = 2. `inverse`: the 1/n scaling is in W; with
  `onesided` (IRFFT) the input's first n // 2 + 1 bins are read as a Hermitian half spectrum
  and the output is real, K = n, c_out = 1.
- STFT (signal [B, L, c], or [B, L] as the legacy exporter writes it; constant `frame_step`,
  constant `window` and/or `frame_length` n; `onesided`): Transpose to [B, c, L] (Reshape for
  [B, L]), Conv with the window-weighted DFT rows as a [2 K, c, n] weight and stride
  `frame_step` (the frames and the transform in one contraction), Reshape and Transpose to
  [B, frames, K, 2].

Refused by name (UnsupportedOpError): a `dft_length`, `axis`, `frame_step` or window computed
at run time, the complex axis as the DFT axis, and any matrix over MAX_MATRIX_ELEMENTS
(2**24 entries, 64 MiB of float32: a complex DFT of 2,048 points, a real one of about 4,096).

Preconditions: after lower_composites (import, static input shapes), before infer_shapes. Runs
onnx's shape inference itself (not strict) and rewrites nodes in graph order, so a DFT reading
another's output (torch.fft.fft2) sees its static shape. In place; `modified` is true when a
node was rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fblc.compiler.graph import Emitter, attr, const_array, replace_output, static_shape
from fblc.compiler.shapes import infer_shapes
from fblc.errors import UnsupportedOpError
from fblc.passes.contracts import ContractPass
from fblc.passes.lower_composites import Lowering

#: the largest cosine/sine matrix the rewrite writes, in entries (64 MiB of float32)
MAX_MATRIX_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Transform:
    """One DFT along one axis: `length` input positions read (after truncation) of an n-point
    transform, `bins` output positions; c_in / c_out: 1 for real, 2 for complex."""

    n: int
    length: int
    bins: int
    c_in: int
    c_out: int
    inverse: bool
    hermitian: bool  # IRFFT: the input is the half spectrum of a real signal


def _unit_circle(r: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi r / n (r integers in [0, n)), with multiples of pi/2 exact."""
    cos, sin = np.cos(2 * np.pi * r / n), np.sin(2 * np.pi * r / n)
    quarter = (4 * r) % n == 0
    step = (4 * r // n) % 4
    cos = np.where(quarter, np.array([1.0, 0.0, -1.0, 0.0])[step], cos)
    sin = np.where(quarter, np.array([0.0, 1.0, 0.0, -1.0])[step], sin)
    return cos, sin


def dft_matrix(t: Transform) -> np.ndarray:
    """W [length c_in, bins c_out] (float64): row t * c_in + part of the input, column k * c_out + part."""
    rows, cols = np.arange(t.length)[:, None], np.arange(t.bins)[None, :]
    cos, sin = _unit_circle((rows * cols) % t.n, t.n)
    sign, scale = (1.0, 1.0 / t.n) if t.inverse else (-1.0, 1.0)
    weight = np.full((t.length, 1), scale)
    if t.hermitian:  # bins 1 .. ceil(n / 2) - 1 stand for their conjugate mirror too
        weight[1:(t.n + 1) // 2] *= 2.0
    re, im = weight * cos, weight * sign * sin  # (a + i b) (re + i im)
    w = np.zeros((t.length, t.c_in, t.bins, t.c_out))
    w[:, 0, :, 0] = re
    if t.c_out == 2:
        w[:, 0, :, 1] = im
    if t.c_in == 2:
        w[:, 1, :, 0] = -im
        if t.c_out == 2:
            w[:, 1, :, 1] = re
    return w.reshape(t.length * t.c_in, t.bins * t.c_out)


def _constant_int(node: ir.Node, index: int, what: str) -> int | None:
    """The scalar constant of input `index`, None when absent; refused by name when computed."""
    value = node.inputs[index] if len(node.inputs) > index else None
    if value is None:
        return None
    array = const_array(value)
    if array is None:
        raise UnsupportedOpError(f"{node.op_type} node '{node.name}': its {what} ('{value.name}') is computed at "
                                 "run time", f"fblc lowers {node.op_type} to a constant matrix; export it with a "
                                 f"constant {what} (static input shapes)", ops=[node.op_type])
    return int(np.asarray(array).reshape(-1)[0])


def _check_size(node: ir.Node, rows: int, cols: int) -> None:
    if rows * cols > MAX_MATRIX_ELEMENTS:
        raise UnsupportedOpError(f"{node.op_type} node '{node.name}' needs a {rows} x {cols} cosine/sine matrix, "
                                 f"over fblc's limit of {MAX_MATRIX_ELEMENTS} entries (MAX_MATRIX_ELEMENTS)",
                                 "fblc lowers DFT to a MatMul by a constant matrix; transform shorter signals "
                                 "(split the axis) or compute the spectrum outside the model", ops=[node.op_type])


def _matrix(e: Emitter, node: ir.Node, t: Transform, like: ir.Value) -> ir.Value:
    _check_size(node, t.length * t.c_in, t.bins * t.c_out)
    return e.const(dft_matrix(t), dtype=like.dtype)


def _dft(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    x = node.inputs[0]
    shape = list(static_shape(x))
    rank = len(shape)
    version = node.version or opset
    axis = _constant_int(node, 2, "axis") if version >= 20 else None
    axis = int(attr(node, "axis", 1)) if version < 20 else (-2 if axis is None else axis)
    if not -rank <= axis < rank or axis % rank == rank - 1 or shape[-1] not in (1, 2):
        raise UnsupportedOpError(f"DFT node '{node.name}' transforms axis {axis} of a {shape} tensor",
                                 "the last axis holds (real, imaginary) and has size 1 or 2; the DFT axis is "
                                 "another", ops=["DFT"])
    axis %= rank
    inverse, onesided = bool(attr(node, "inverse", 0)), bool(attr(node, "onesided", 0))
    hermitian = inverse and onesided
    length = shape[axis]
    n = _constant_int(node, 1, "dft_length")
    n = n if n is not None else (2 * (length - 1) if hermitian else length)
    read = min(length, n // 2 + 1 if hermitian else n)  # positions past these are truncated
    bins = n // 2 + 1 if onesided and not inverse else n
    t = Transform(n, read, bins, shape[-1], 1 if hermitian else 2, inverse, hermitian)
    perm = [d for d in range(rank) if d not in (axis, rank - 1)] + [axis, rank - 1]
    moved = x if perm == list(range(rank)) else e.op("Transpose", x, perm=perm)
    if read < length:
        moved = e.op("Slice", moved, e.ints([0]), e.ints([read]), e.ints([rank - 2]))
    outer = [shape[d] for d in perm[:-2]]
    flat = e.reshape(moved, [int(np.prod(outer, dtype=np.int64)), read * t.c_in])
    out = e.reshape(e.op("MatMul", flat, _matrix(e, node, t, x)), outer + [bins, t.c_out])
    if perm == list(range(rank)):
        return out
    return e.op("Transpose", out, perm=[int(i) for i in np.argsort(perm)])


def _stft(e: Emitter, node: ir.Node, opset: int) -> ir.Value:
    signal = node.inputs[0]
    shape = static_shape(signal)
    if len(shape) not in (2, 3):
        raise UnsupportedOpError(f"STFT node '{node.name}' reads a signal of shape {list(shape)}",
                                 "ONNX's STFT takes [batch, length, 1 or 2]", ops=["STFT"])
    batch, length, c_in = (*shape, 1) if len(shape) == 2 else shape  # the legacy exporter writes [batch, length]
    step = _constant_int(node, 1, "frame_step")
    window_value = node.inputs[2] if len(node.inputs) > 2 else None
    window = const_array(window_value) if window_value is not None else None
    if window_value is not None and window is None:
        raise UnsupportedOpError(f"STFT node '{node.name}': its window ('{window_value.name}') is computed at run "
                                 "time", "fblc folds the window into a constant Conv weight; export a constant "
                                 "window", ops=["STFT"])
    frame = _constant_int(node, 3, "frame_length")
    n = frame if frame is not None else (len(window) if window is not None else 0)
    if step is None or n <= 0 or n > length:
        raise UnsupportedOpError(f"STFT node '{node.name}': frame_step {step}, frame length {n} on a signal of "
                                 f"{length}", "ONNX needs frame_step and a window or frame_length no longer than "
                                 "the signal", ops=["STFT"])
    onesided = bool(attr(node, "onesided", 1))  # the spec's default, onnxruntime's and the reference's (onnx
    # 1.23's shape inference assumes 0: the exporters write the attribute)
    t = Transform(n, n, n // 2 + 1 if onesided else n, c_in, 2, inverse=False, hermitian=False)
    _check_size(node, t.length * t.c_in, t.bins * 2)
    taps = dft_matrix(t).reshape(n, c_in, t.bins * 2)
    if window is not None:
        taps = taps * np.asarray(window, np.float64).reshape(n, 1, 1)
    weight = e.const(np.transpose(taps, (2, 1, 0)), dtype=signal.dtype)  # [2 K, c, n]
    channels = e.op("Transpose", signal, perm=[0, 2, 1]) if len(shape) == 3 else e.reshape(signal, [batch, 1, length])
    spectra = e.op("Conv", channels, weight, kernel_shape=[n], strides=[step])
    frames = (length - n) // step + 1
    return e.op("Transpose", e.reshape(spectra, [batch, t.bins, 2, frames]), perm=[0, 3, 1, 2])


DFT_LOWERINGS: dict[str, Lowering] = {
    "DFT": Lowering(_dft, "Transpose, Slice, Reshape, MatMul by a constant cosine/sine matrix",
                    f"dft_length or axis computed at run time; a matrix over {MAX_MATRIX_ELEMENTS} entries "
                    "(complex n > 2048, real n > ~4096) is refused"),
    "STFT": Lowering(_stft, "Transpose, Conv by constant window-weighted cosine/sine taps, Reshape",
                     "frame_step or window computed at run time; a matrix over the DFT's limit is refused"),
}


def _static(node: ir.Node) -> bool:
    x = node.inputs[0]
    return x is not None and x.shape is not None and x.shape.is_static() and x.dtype is not None


class LowerDft(ContractPass):
    """Rewrite DFT and STFT into MatMul / Conv by constant cosine/sine matrices (in place)."""

    name = "lower_dft"
    requires_facts = ("static inputs",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        pending = [n for n in graph if n.domain in ("", "ai.onnx") and n.op_type in DFT_LOWERINGS]
        if not pending:
            return ir.passes.PassResult(model, False)
        infer_shapes(model, require_static=False)
        opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 18)))
        emitter = Emitter(graph, stage="forward")
        modified = False
        for node in pending:  # graph order: a transform of a transform sees its input's shape
            if not _static(node):
                continue  # left for infer_shapes, which names the input without a static shape
            emitter.anchor, emitter.prefix = node, f"{node.name}/lowered"
            replace_output(node.outputs[0], DFT_LOWERINGS[node.op_type].rewrite(emitter, node, opset), "lowered")
            graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified)
