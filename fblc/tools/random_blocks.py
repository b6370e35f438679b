"""The generator's blocks beyond the elementwise, view and contraction ones of fblc/tools/random_graphs.py:
attention over a token graph's padding mask, the token embedding that starts such a graph, Exp, Log, Pow,
Clip, Split, Resize, ConvTranspose and a comparison Cast to a float gate."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from fblc.tools.graph_maker import GraphInput, Maker, Shape, Tensor, grower


@grower("exp")
def _exp(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Exp of a bounded value (Tanh's), so that fp16 and the finite differences stay in range."""
    return Tensor(m.op("Exp", [m.op("Tanh", [t.name])]), t.shape)


def _positive(m: Maker, t: Tensor) -> str:
    """x * x + c, c > 0 a parameter: an operand for Log and a fractional Pow."""
    return m.op("Add", [m.op("Mul", [t.name, t.name]), m.param((), positive=True)])


@grower("log")
def _log(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    return Tensor(m.op("Log", [_positive(m, t)]), t.shape)


@grower("pow")
def _pow(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Pow of any base by 2 or 3, or of a positive base by a constant or a parameter (whose gradient reads log)."""
    if m.rng.random() < 0.4:
        return Tensor(m.op("Pow", [t.name, m.scalar(float(m.rng.choice([2.0, 3.0])))]), t.shape)
    exponent = m.param((), 0.5) if m.rng.random() < 0.5 else m.scalar(float(m.rng.choice([0.5, -0.5, 1.5])))
    return Tensor(m.op("Pow", [_positive(m, t), exponent]), t.shape)


@grower("clip")
def _clip(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Clip between constants, either bound absent (ReLU6 and its kin)."""
    low, high = m.rng.choice([None, -1.0, -0.5, 0.0]), m.rng.choice([None, 0.5, 1.0, 6.0])
    bounds = ["" if b is None else m.scalar(float(b)) for b in (low, high)]
    while bounds and bounds[-1] == "":
        bounds.pop()
    return Tensor(m.op("Clip", [t.name, *bounds]), t.shape)


@grower("split")
def _split(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Split an axis in two; a gated product of equal halves (GLU), else the parts Concat in swapped order."""
    axes = [a for a in range(1, len(t.shape)) if t.shape[a] >= 2]
    if not axes:
        return None
    axis = axes[m.rng.integers(len(axes))]
    length = t.shape[axis]
    if length % 2 == 0 and m.rng.random() < 0.5:
        first, second = m.ops_multi("Split", [t.name], 2, axis=axis, num_outputs=2)
        half = tuple(d // 2 if a == axis else d for a, d in enumerate(t.shape))
        return Tensor(m.op("Mul", [first, m.op("Sigmoid", [second])]), half)
    head = int(m.rng.integers(1, length))
    first, second = m.ops_multi("Split", [t.name, m.ints([head, length - head])], 2, axis=axis)
    return Tensor(m.op("Concat", [second, first], axis=axis), t.shape)


@grower("resize")
def _resize(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Resize the spatial axes, nearest or linear, by scales (2, or 1/2) or to sizes."""
    if len(t.shape) != 4:
        return None
    n, c, h, w = t.shape
    mode = str(m.rng.choice(["nearest", "linear"]))
    attrs: dict[str, object] = {"mode": mode, "coordinate_transformation_mode": str(m.rng.choice(
        ["half_pixel", "asymmetric", "pytorch_half_pixel"] + (["align_corners"] if mode == "linear" else [])))}
    if mode == "nearest":
        attrs["nearest_mode"] = str(m.rng.choice(["floor", "round_prefer_floor", "ceil"]))
    if m.rng.random() < 0.5:
        scale = 2.0 if m.rng.random() < 0.7 or min(h, w) < 4 else 0.5
        size = (int(h * scale), int(w * scale))
        return Tensor(m.op("Resize", [t.name, "", m.constant(np.array([1, 1, scale, scale], np.float32))], **attrs),
                  (n, c, *size))
    size = (int(m.rng.integers(2, 2 * h + 1)), int(m.rng.integers(2, 2 * w + 1)))
    return Tensor(m.op("Resize", [t.name, "", "", m.ints([n, c, *size])], **attrs), (n, c, *size))


@grower("conv_transpose")
def _conv_transpose(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    if len(t.shape) != 4:
        return None
    n, c, h, w = t.shape
    k, stride = int(m.rng.choice([1, 2, 3])), int(m.rng.choice([1, 2]))
    pad = int(m.rng.integers(0, k))
    out_c, group = (c, c) if m.rng.random() < 0.25 else (int(m.rng.integers(2, 7)), 1)
    size = lambda d: (d - 1) * stride - 2 * pad + k  # noqa: E731
    if size(h) < 1 or size(w) < 1:
        return None
    weight = m.param((c, out_c // group, k, k), 1 / np.sqrt(c // group * k))
    # a bias with groups: onnx 1.23's reference evaluator (the fuzzer's float64 forward) adds it wrongly
    biased = group == 1 and m.rng.random() < 0.5
    inputs = [t.name, weight] + ([m.param((out_c,), 0.1)] if biased else [])
    out = m.op("ConvTranspose", inputs, kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4, group=group)
    return Tensor(out, (n, out_c, size(h), size(w)))


def _heads(m: Maker, x: str, shape: Shape, heads: int, perm: list[int]) -> str:
    """[B, T, D] -> [B, H, T, D/H] (perm [0, 2, 1, 3]; [0, 2, 3, 1] for K^T)."""
    split = m.op("Reshape", [x, m.ints([0, 0, heads, shape[-1] // heads])])
    return m.op("Transpose", [split], perm=perm)


def _mask_bias(m: Maker, rank: int) -> str | None:
    """A token graph's padding mask (an int64 input made on first use) as an additive bias that broadcasts to
    scores of `rank` (3 or 4): (1 - Cast(mask)) * -10000 over the keys."""
    if m.tokens is None:
        return None
    if rank not in m.mask_bias:
        if not any(spec.kind == "mask" for spec in m.inputs):
            m.inputs.append(GraphInput("mask", m.tokens, "mask"))
        keep = m.op("Cast", ["mask"], to=TensorProto.FLOAT)
        bias = m.op("Mul", [m.op("Sub", [m.scalar(1.0), keep]), m.scalar(-10000.0)])
        m.mask_bias[rank] = m.op("Unsqueeze", [bias, m.ints(list(range(1, rank - 1)))])
    return m.mask_bias[rank]


@grower("attention")
def _attention(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Scaled dot-product self-attention over axis 1 of a [B, T, D] tensor: Q K^T and P V multiply activations
    by activations; masked when the tensor's (B, T) are a token graph's."""
    if len(t.shape) != 3:
        return None
    d = t.shape[-1]
    heads = 2 if d % 2 == 0 and m.rng.random() < 0.5 else 1
    q, k, v = (m.op("MatMul", [t.name, m.param((d, d), 1 / np.sqrt(d))]) for _ in range(3))
    if heads > 1:
        q, v = (_heads(m, x, t.shape, heads, [0, 2, 1, 3]) for x in (q, v))
        k = _heads(m, k, t.shape, heads, [0, 2, 3, 1])
    else:
        k = m.op("Transpose", [k], perm=[0, 2, 1])
    scores = m.op("Mul", [m.op("MatMul", [q, k]), m.scalar(float(1 / np.sqrt(d // heads)))])
    bias = _mask_bias(m, 4 if heads > 1 else 3) if m.tokens == t.shape[:2] and m.rng.random() < 0.8 else None
    if bias is not None:
        scores = m.op("Add", [scores, bias])
    out = m.op("MatMul", [m.op("Softmax", [scores], axis=-1), v])
    if heads > 1:
        out = m.op("Reshape", [m.op("Transpose", [out], perm=[0, 2, 1, 3]), m.ints([0, 0, d])])
    return Tensor(out, t.shape)


@grower("gate")
def _gate(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """x * Cast(x > c): a comparison Cast to float gates the tensor (no gradient through the Cast)."""
    gate = m.op("Cast", [m.op("Greater", [t.name, m.scalar(float(m.rng.choice([-0.5, 0.0, 0.5])))])],
                to=TensorProto.FLOAT)
    return Tensor(m.op("Mul", [t.name, gate]), t.shape)


def token_start(m: Maker, batch: int) -> Tensor:
    """int64 ids [B, T] through an embedding table [V, D] (a Gather of a parameter)."""
    length, vocabulary, width = (int(m.rng.integers(2, 7)), int(m.rng.integers(3, 12)), int(m.rng.integers(2, 9)))
    m.tokens = (batch, length)
    m.inputs.append(GraphInput("ids", m.tokens, "ids", vocabulary))
    return Tensor(m.op("Gather", [m.param((vocabulary, width)), "ids"], axis=0), (batch, length, width))


