"""Random valid ONNX classifiers over the ops fblc trains, for the fuzzer (fblc/tools/fuzz.py).

A graph starts from a float input `x` of rank 2, 3 or 4, or from int64 token ids through an
embedding table (STARTS), and applies a chain of random op builders,
each drawn from GROWERS and applicable to the current tensor's shape (convolutions and pools
need rank 4, a MatMul a last axis, ...); branches join again (residual Adds, Concat), views
chain (Transpose, Reshape, Slice, Unsqueeze/Squeeze, Expand), gathers take constant indices (repeated,
negative), Where selects under a constant mask; attention blocks multiply activations by activations
(Q K^T and P V, one or two heads) under an int64 padding mask input that is Cast to an additive bias;
Exp, Log and Pow take bounded or positive operands; parameters get broadcastable shapes.
The first op has parameters (so every later op's gradient rule is on the path to one), and
the chain ends in Flatten and a Gemm to `classes` logits, so every graph trains with the
cross-entropy loss. Values stay small (weights scaled by fan-in, divisors kept away from 0) so
that a finite-difference gradient is meaningful. Every graph passes onnx's checker with full
shape inference; `RandomGraph.ops` lists the op types it used and `RandomGraph.inputs` its inputs
(`RandomGraph.feeds` draws a batch for them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
Shape = tuple[int, ...]


@dataclass(frozen=True)
class GraphInput:
    name: str
    shape: Shape
    #: "float" (standard normal), "ids" (int64 in [0, high)) or "mask" (int64 0/1, position 0 always 1)
    kind: str
    high: int = 0


@dataclass
class RandomGraph:
    model: onnx.ModelProto
    ops: list[str]
    inputs: list[GraphInput]
    classes: int

    @property
    def batch(self) -> int:
        return self.inputs[0].shape[0]

    def feeds(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """A batch for the graph's inputs: floats, token ids, padding masks."""
        feeds: dict[str, np.ndarray] = {}
        for spec in self.inputs:
            if spec.kind == "float":
                feeds[spec.name] = rng.standard_normal(spec.shape).astype(np.float32)
            elif spec.kind == "ids":
                feeds[spec.name] = rng.integers(0, spec.high, spec.shape).astype(np.int64)
            else:  # a padding mask: every row attends to its first position at least
                mask = rng.integers(0, 2, spec.shape).astype(np.int64)
                mask[:, 0] = 1
                feeds[spec.name] = mask
        return feeds


@dataclass
class _Maker:
    rng: np.random.Generator
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: dict[str, np.ndarray] = field(default_factory=dict)
    ops: list[str] = field(default_factory=list)
    inputs: list[GraphInput] = field(default_factory=list)
    #: a token graph's padding mask as additive attention biases, by the rank of the scores they broadcast to
    mask_bias: dict[int, str] = field(default_factory=dict)
    #: a token graph's (batch, sequence length): the scores a mask applies to
    tokens: Shape | None = None

    def fresh(self, hint: str) -> str:
        return f"{hint}_{len(self.nodes) + len(self.inits)}"

    def param(self, shape: Shape, scale: float = 1.0, positive: bool = False) -> str:
        name = self.fresh("p")
        values = self.rng.standard_normal(shape) * scale
        self.inits[name] = (np.abs(values) + 0.5 if positive else values).astype(np.float32)
        return name

    def constant(self, values: np.ndarray) -> str:
        """A constant: an initializer when integer or bool, a Constant node when float (an initializer of
        float type would be a trainable parameter, as an exporter's weights are)."""
        name = self.fresh("c")
        if values.dtype != np.float32:
            self.inits[name] = values
        else:
            self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                               value=numpy_helper.from_array(values, name)))
        return name

    def ints(self, values: Sequence[int] | np.ndarray) -> str:
        return self.constant(np.asarray(values, np.int64))

    def scalar(self, value: float) -> str:
        return self.constant(np.array(value, np.float32))

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        return self.ops_multi(op_type, inputs, 1, **attrs)[0]

    def ops_multi(self, op_type: str, inputs: list[str], outputs: int, **attrs: object) -> list[str]:
        first = self.fresh(op_type.lower())
        names = [first] + [f"{first}_{i}" for i in range(1, outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=first, **attrs))
        self.ops.append(op_type)
        return names


@dataclass
class _T:
    """A tensor of the graph being grown: its name and static shape."""
    name: str
    shape: Shape


Grower = Callable[[_Maker, _T, list[_T]], "_T | None"]
#: builders keyed by name: each takes the current tensor (and the live ones, for joins) and
#: returns the grown tensor, or None when it does not apply to that shape
GROWERS: dict[str, Grower] = {}


def grower(name: str) -> Callable[[Grower], Grower]:
    def register(function: Grower) -> Grower:
        GROWERS[name] = function
        return function
    return register


UNARY = ("Relu", "Sigmoid", "Tanh", "Neg", "Softplus", "Erf", "Sin", "Cos", "Softsign", "Elu", "LeakyRelu",
         "Selu", "Celu", "Mish", "HardSwish")


@grower("unary")
def _unary(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    return _T(m.op(str(m.rng.choice(UNARY)), [t.name]), t.shape)


def _broadcast_shape(m: _Maker, shape: Shape) -> Shape:
    """A shape that broadcasts to `shape`: trailing axes, some set to 1, or a scalar."""
    kind = m.rng.integers(4)
    if kind == 0:
        return ()
    if kind == 1:
        return shape
    trailing = shape[m.rng.integers(1, len(shape)):] if len(shape) > 1 else shape
    return tuple(d if m.rng.random() < 0.6 else 1 for d in trailing)


@grower("binary")
def _binary(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    op = str(m.rng.choice(["Add", "Sub", "Mul", "Div", "Max", "Min"]))
    other = m.param(_broadcast_shape(m, t.shape), positive=op in ("Div", "Mul"))
    inputs = [t.name, other] if m.rng.random() < 0.7 or op == "Div" else [other, t.name]
    return _T(m.op(op, inputs), t.shape)


@grower("square_root")
def _square_root(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    square = m.op("Mul", [t.name, t.name])
    return _T(m.op("Sqrt", [m.op("Add", [square, m.param((), positive=True)])]), t.shape)


@grower("residual")
def _residual(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    partners = [u for u in live if u.shape == t.shape and u.name != t.name]
    if not partners:
        return None
    partner = partners[m.rng.integers(len(partners))]
    # no Sub: x - (x - p) cancels to p plus rounding, and a norm after it amplifies the rounding
    return _T(m.op(str(m.rng.choice(["Add", "Mul"])), [t.name, partner.name]), t.shape)


@grower("concat")
def _concat(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    axis = int(m.rng.integers(1, len(t.shape))) if len(t.shape) > 1 else 0
    branch = m.op("Tanh", [t.name])
    shape = list(t.shape)
    shape[axis] *= 2
    return _T(m.op("Concat", [t.name, branch], axis=axis), tuple(shape))


@grower("matmul")
def _matmul(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    k, n = t.shape[-1], int(m.rng.integers(2, 9))
    if len(t.shape) == 2 and m.rng.random() < 0.5:
        trans_b = int(m.rng.integers(2))
        w = m.param((n, k) if trans_b else (k, n), 1 / np.sqrt(k))
        bias = m.param((n,) if m.rng.random() < 0.5 else (1, n), 0.1)
        return _T(m.op("Gemm", [t.name, w, bias], transB=trans_b, alpha=float(m.rng.choice([1.0, 0.5]))),
                  (t.shape[0], n))
    w = m.param((k, n), 1 / np.sqrt(k))
    return _T(m.op("MatMul", [t.name, w]), (*t.shape[:-1], n))


@grower("conv")
def _conv(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    if len(t.shape) != 4:
        return None
    n, c, h, w = t.shape
    k = int(m.rng.choice([1, 2, 3]))
    stride = int(m.rng.choice([1, 1, 2]))
    dilation = 2 if k > 1 and m.rng.random() < 0.2 else 1
    pad = int(m.rng.integers(0, k)) if k > 1 else 0
    span = (k - 1) * dilation + 1
    if h + 2 * pad < span or w + 2 * pad < span:
        return None
    depthwise = m.rng.random() < 0.3
    out_c, group = (c, c) if depthwise else (int(m.rng.integers(2, 9)), 1)
    weight = m.param((out_c, c // group, k, k), 1 / np.sqrt(c // group * k * k))
    inputs = [t.name, weight] + ([m.param((out_c,), 0.1)] if m.rng.random() < 0.6 else [])
    out = m.op("Conv", inputs, kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4,
               dilations=[dilation, dilation], group=group)
    size = lambda d: (d + 2 * pad - span) // stride + 1  # noqa: E731
    return _T(out, (n, out_c, size(h), size(w)))


@grower("pool")
def _pool(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    if len(t.shape) != 4 or min(t.shape[2:]) < 2:
        return None
    kind = int(m.rng.integers(3))
    if kind == 2:
        return _T(m.op("GlobalAveragePool", [t.name]), (*t.shape[:2], 1, 1))
    k, stride, pad = (2, 2, 0) if m.rng.random() < 0.5 else (3, 1, 1)
    if min(t.shape[2:]) + 2 * pad < k:
        return None
    op = "MaxPool" if kind == 0 else "AveragePool"
    attrs = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [pad] * 4}
    if op == "AveragePool":
        attrs["count_include_pad"] = int(m.rng.integers(2))
    out = m.op(op, [t.name], **attrs)
    size = lambda d: (d + 2 * pad - k) // stride + 1  # noqa: E731
    return _T(out, (*t.shape[:2], size(t.shape[2]), size(t.shape[3])))


@grower("normalize")
def _normalize(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    if len(t.shape) == 4 and m.rng.random() < 0.5:
        c = t.shape[1]
        stats = [m.param((c,), 0.1), m.param((c,), 0.1), m.param((c,), 0.2), m.param((c,), 0.5, positive=True)]
        return _T(m.op("BatchNormalization", [t.name, *stats]), t.shape)
    if m.rng.random() < 0.5:
        axis = int(m.rng.integers(1, len(t.shape))) if len(t.shape) > 1 else -1
        return _T(m.op("Softmax", [t.name], axis=axis), t.shape)
    width = t.shape[-1]
    return _T(m.op("LayerNormalization", [t.name, m.param((width,), 0.5, positive=True), m.param((width,), 0.1)],
                   axis=-1), t.shape)


@grower("reduce")
def _reduce(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    if len(t.shape) < 3:
        return None
    axis = int(m.rng.integers(1, len(t.shape)))
    op = str(m.rng.choice(["ReduceSum", "ReduceMean", "ReduceMax"]))
    out = m.op(op, [t.name, m.ints([axis])], keepdims=1)
    return _T(out, tuple(1 if i == axis else d for i, d in enumerate(t.shape)))


@grower("transpose")
def _transpose(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    if len(t.shape) < 3:
        return None
    rest = [int(a) for a in m.rng.permutation(np.arange(1, len(t.shape)))]
    perm = [0] + rest
    return _T(m.op("Transpose", [t.name], perm=perm), tuple(t.shape[a] for a in perm))


@grower("reshape")
def _reshape(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Merge two neighbouring axes, or split one into two factors."""
    shape = list(t.shape)
    if len(shape) >= 3 and m.rng.random() < 0.5:
        axis = int(m.rng.integers(1, len(shape) - 1))
        target = shape[:axis] + [shape[axis] * shape[axis + 1]] + shape[axis + 2:]
    else:
        splittable = [a for a in range(1, len(shape)) if any(shape[a] % f == 0 for f in (2, 3)) and shape[a] > 3]
        if not splittable or len(shape) >= 4:
            return None
        axis = splittable[m.rng.integers(len(splittable))]
        factor = 2 if shape[axis] % 2 == 0 else 3
        target = shape[:axis] + [factor, shape[axis] // factor] + shape[axis + 1:]
    return _T(m.op("Reshape", [t.name, m.ints([0] + target[1:])]), tuple(target))


@grower("slice")
def _slice(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    axes = [a for a in range(1, len(t.shape)) if t.shape[a] >= 3]
    if not axes:
        return None
    axis = axes[m.rng.integers(len(axes))]
    length = t.shape[axis]
    start, step = int(m.rng.integers(0, length // 2)), int(m.rng.choice([1, 1, 2]))
    end = int(m.rng.integers(start + 1, length + 1))
    out = m.op("Slice", [t.name, m.ints([start]), m.ints([end]), m.ints([axis]), m.ints([step])])
    return _T(out, tuple(len(range(start, end, step)) if a == axis else d for a, d in enumerate(t.shape)))


def _unsqueezed(m: _Maker, t: _T) -> tuple[_T, int] | None:
    """A new axis of 1 after the batch axis (and where it is); None at rank 4."""
    if len(t.shape) >= 4:
        return None
    axis = int(m.rng.integers(1, len(t.shape) + 1))
    return _T(m.op("Unsqueeze", [t.name, m.ints([axis])]), (*t.shape[:axis], 1, *t.shape[axis:])), axis


@grower("unsqueeze")
def _unsqueeze(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Unsqueeze, and half the time Squeeze back."""
    if (up := _unsqueezed(m, t)) is None:
        return None
    if m.rng.random() < 0.5:
        return up[0]
    return _T(m.op("Squeeze", [up[0].name, m.ints([up[1]])]), t.shape)


@grower("pad")
def _pad(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    if len(t.shape) < 3:
        return None
    before = [0, 0] + [int(m.rng.integers(0, 2)) for _ in t.shape[2:]]
    after = [0, 0] + [int(m.rng.integers(0, 2)) for _ in t.shape[2:]]
    out = m.op("Pad", [t.name, m.ints(before + after)], mode="constant")
    return _T(out, tuple(d + b + a for d, b, a in zip(t.shape, before, after)))


@grower("gather")
def _gather(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Gather or GatherElements along an axis with constant indices: repeated, negative, any order."""
    if len(t.shape) < 2:
        return None
    axis = int(m.rng.integers(1, len(t.shape)))
    length, taken = t.shape[axis], int(m.rng.integers(1, t.shape[axis] + 3))
    shape = (*t.shape[:axis], taken, *t.shape[axis + 1:])
    if m.rng.random() < 0.5:
        return _T(m.op("Gather", [t.name, m.ints(m.rng.integers(-length, length, taken))], axis=axis), shape)
    return _T(m.op("GatherElements", [t.name, m.ints(m.rng.integers(-length, length, shape))], axis=axis), shape)


@grower("select")
def _select(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Where with a constant mask between the tensor and a parameter (both get a gradient)."""
    mask = m.constant(m.rng.random(_broadcast_shape(m, t.shape)) < 0.5)
    other = m.param(_broadcast_shape(m, t.shape), 0.5)
    inputs = [mask, t.name, other] if m.rng.random() < 0.5 else [mask, other, t.name]
    return _T(m.op("Where", inputs), t.shape)


@grower("expand")
def _expand(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Unsqueeze an axis and Expand it to 2 or 3 copies (a broadcast whose gradient sums them)."""
    if (up := _unsqueezed(m, t)) is None:
        return None
    shape = tuple(int(m.rng.integers(2, 4)) if a == up[1] else d for a, d in enumerate(up[0].shape))
    return _T(m.op("Expand", [up[0].name, m.ints(shape)]), shape)


@grower("exp")
def _exp(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Exp of a bounded value (Tanh's), so that fp16 and the finite differences stay in range."""
    return _T(m.op("Exp", [m.op("Tanh", [t.name])]), t.shape)


def _positive(m: _Maker, t: _T) -> str:
    """x * x + c, c > 0 a parameter: an operand for Log and a fractional Pow."""
    return m.op("Add", [m.op("Mul", [t.name, t.name]), m.param((), positive=True)])


@grower("log")
def _log(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    return _T(m.op("Log", [_positive(m, t)]), t.shape)


@grower("pow")
def _pow(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Pow of any base by 2 or 3, or of a positive base by a constant or a parameter (whose gradient reads log)."""
    if m.rng.random() < 0.4:
        return _T(m.op("Pow", [t.name, m.scalar(float(m.rng.choice([2.0, 3.0])))]), t.shape)
    exponent = m.param((), 0.5) if m.rng.random() < 0.5 else m.scalar(float(m.rng.choice([0.5, -0.5, 1.5])))
    return _T(m.op("Pow", [_positive(m, t), exponent]), t.shape)


@grower("clip")
def _clip(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Clip between constants, either bound absent (ReLU6 and its kin)."""
    low, high = m.rng.choice([None, -1.0, -0.5, 0.0]), m.rng.choice([None, 0.5, 1.0, 6.0])
    bounds = ["" if b is None else m.scalar(float(b)) for b in (low, high)]
    while bounds and bounds[-1] == "":
        bounds.pop()
    return _T(m.op("Clip", [t.name, *bounds]), t.shape)


@grower("split")
def _split(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """Split an axis in two; a gated product of equal halves (GLU), else the parts Concat in swapped order."""
    axes = [a for a in range(1, len(t.shape)) if t.shape[a] >= 2]
    if not axes:
        return None
    axis = axes[m.rng.integers(len(axes))]
    length = t.shape[axis]
    if length % 2 == 0 and m.rng.random() < 0.5:
        first, second = m.ops_multi("Split", [t.name], 2, axis=axis, num_outputs=2)
        half = tuple(d // 2 if a == axis else d for a, d in enumerate(t.shape))
        return _T(m.op("Mul", [first, m.op("Sigmoid", [second])]), half)
    head = int(m.rng.integers(1, length))
    first, second = m.ops_multi("Split", [t.name, m.ints([head, length - head])], 2, axis=axis)
    return _T(m.op("Concat", [second, first], axis=axis), t.shape)


@grower("resize")
def _resize(m: _Maker, t: _T, live: list[_T]) -> _T | None:
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
        return _T(m.op("Resize", [t.name, "", m.constant(np.array([1, 1, scale, scale], np.float32))], **attrs),
                  (n, c, *size))
    size = (int(m.rng.integers(2, 2 * h + 1)), int(m.rng.integers(2, 2 * w + 1)))
    return _T(m.op("Resize", [t.name, "", "", m.ints([n, c, *size])], **attrs), (n, c, *size))


@grower("conv_transpose")
def _conv_transpose(m: _Maker, t: _T, live: list[_T]) -> _T | None:
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
    return _T(out, (n, out_c, size(h), size(w)))


def _heads(m: _Maker, x: str, shape: Shape, heads: int, perm: list[int]) -> str:
    """[B, T, D] -> [B, H, T, D/H] (perm [0, 2, 1, 3]; [0, 2, 3, 1] for K^T)."""
    split = m.op("Reshape", [x, m.ints([0, 0, heads, shape[-1] // heads])])
    return m.op("Transpose", [split], perm=perm)


def _mask_bias(m: _Maker, rank: int) -> str | None:
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
def _attention(m: _Maker, t: _T, live: list[_T]) -> _T | None:
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
    return _T(out, t.shape)


@grower("gate")
def _gate(m: _Maker, t: _T, live: list[_T]) -> _T | None:
    """x * Cast(x > c): a comparison Cast to float gates the tensor (no gradient through the Cast)."""
    gate = m.op("Cast", [m.op("Greater", [t.name, m.scalar(float(m.rng.choice([-0.5, 0.0, 0.5])))])],
                to=TensorProto.FLOAT)
    return _T(m.op("Mul", [t.name, gate]), t.shape)


def _dense_start(m: _Maker, batch: int) -> _T:
    rank = int(m.rng.choice([2, 3, 4, 4]))
    shape = (batch, *(int(m.rng.integers(2, 8)) for _ in range(rank - 1)))
    m.inputs.append(GraphInput("x", shape, "float"))
    return _T("x", shape)


def _token_start(m: _Maker, batch: int) -> _T:
    """int64 ids [B, T] through an embedding table [V, D] (a Gather of a parameter)."""
    length, vocabulary, width = (int(m.rng.integers(2, 7)), int(m.rng.integers(3, 12)), int(m.rng.integers(2, 9)))
    m.tokens = (batch, length)
    m.inputs.append(GraphInput("ids", m.tokens, "ids", vocabulary))
    return _T(m.op("Gather", [m.param((vocabulary, width)), "ids"], axis=0), (batch, length, width))


#: how a graph begins: a float input, or token ids through an embedding
STARTS: dict[str, Callable[[_Maker, int], _T]] = {"dense": _dense_start, "tokens": _token_start}
ELEMENT_TYPES = {"float": TensorProto.FLOAT, "ids": TensorProto.INT64, "mask": TensorProto.INT64}


#: growers with parameters, one of which starts every graph
PARAMETRIC = ("binary", "matmul", "conv", "conv_transpose")


def random_graph(seed: int, depth: tuple[int, int] = (2, 7), conv_site: bool = False) -> RandomGraph:
    """One random classifier (see the module docstring); the same seed gives the same graph. `conv_site`: a
    dense rank-4 input whose first op is a Conv of groups 1 (a site for the Conv adapters)."""
    rng = np.random.default_rng(seed)
    m = _Maker(rng)
    batch = int(rng.integers(2, 4))
    start = "dense" if conv_site else str(rng.choice(sorted(STARTS), p=[0.7, 0.3]))
    t = STARTS[start](m, batch)
    if conv_site:
        t = _conv_site(m, batch)
    live = [t]
    names = sorted(GROWERS)
    for index in range(int(rng.integers(*depth))):
        choices = [n for n in names if n in PARAMETRIC] if index == 0 and start == "dense" else names
        for _attempt in range(8):
            grown = GROWERS[choices[rng.integers(len(choices))]](m, t, live)
            if grown is not None and 0 < int(np.prod(grown.shape)) <= 4096:
                t = grown
                live.append(t)
                break
    flat = m.op("Flatten", [t.name], axis=1)
    features = int(np.prod(t.shape[1:]))
    classes = int(rng.integers(2, 6))
    logits = m.op("Gemm", [flat, m.param((classes, features), 1 / np.sqrt(features)), m.param((classes,), 0.1)],
                  transB=1)
    inputs = [helper.make_tensor_value_info(spec.name, ELEMENT_TYPES[spec.kind], list(spec.shape))
              for spec in m.inputs]
    graph = helper.make_graph(m.nodes, f"fuzz_{seed}", inputs,
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [batch, classes])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in m.inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return RandomGraph(model, m.ops, list(m.inputs), classes)


def _conv_site(m: _Maker, batch: int) -> _T:
    """A rank-4 float input `x` (replacing the drawn one) and a 1x1 Conv of groups 1 on it, >= 2 channels each side."""
    m.inputs.clear()
    shape = (batch, int(m.rng.integers(2, 6)), int(m.rng.integers(3, 7)), int(m.rng.integers(3, 7)))
    m.inputs.append(GraphInput("x", shape, "float"))
    c, k = shape[1], 1  # pointwise: a site under every --adapter-sites selection (auto: pointwise beside depthwise)
    out_c = int(m.rng.integers(2, 7))
    out = m.op("Conv", ["x", m.param((out_c, c, k, k), 1 / np.sqrt(c * k * k)), m.param((out_c,), 0.1)],
               kernel_shape=[k, k], pads=[k // 2] * 4)
    return _T(out, (batch, out_c, *shape[2:]))
