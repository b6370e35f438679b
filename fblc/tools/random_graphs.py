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

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fblc.tools.graph_maker import GROWERS, GraphInput, Maker, Shape, Tensor, grower
from fblc.tools.random_blocks import token_start

OPSET = 18


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


UNARY = ("Relu", "Sigmoid", "Tanh", "Neg", "Softplus", "Erf", "Sin", "Cos", "Softsign", "Elu", "LeakyRelu",
         "Selu", "Celu", "Mish", "HardSwish")


@grower("unary")
def _unary(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    return Tensor(m.op(str(m.rng.choice(UNARY)), [t.name]), t.shape)


def _broadcast_shape(m: Maker, shape: Shape) -> Shape:
    """A shape that broadcasts to `shape`: trailing axes, some set to 1, or a scalar."""
    kind = m.rng.integers(4)
    if kind == 0:
        return ()
    if kind == 1:
        return shape
    trailing = shape[m.rng.integers(1, len(shape)):] if len(shape) > 1 else shape
    return tuple(d if m.rng.random() < 0.6 else 1 for d in trailing)


@grower("binary")
def _binary(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    op = str(m.rng.choice(["Add", "Sub", "Mul", "Div", "Max", "Min"]))
    other = m.param(_broadcast_shape(m, t.shape), positive=op in ("Div", "Mul"))
    inputs = [t.name, other] if m.rng.random() < 0.7 or op == "Div" else [other, t.name]
    return Tensor(m.op(op, inputs), t.shape)


@grower("square_root")
def _square_root(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    square = m.op("Mul", [t.name, t.name])
    return Tensor(m.op("Sqrt", [m.op("Add", [square, m.param((), positive=True)])]), t.shape)


@grower("residual")
def _residual(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    partners = [u for u in live if u.shape == t.shape and u.name != t.name]
    if not partners:
        return None
    partner = partners[m.rng.integers(len(partners))]
    # no Sub: x - (x - p) cancels to p plus rounding, and a norm after it amplifies the rounding
    return Tensor(m.op(str(m.rng.choice(["Add", "Mul"])), [t.name, partner.name]), t.shape)


@grower("concat")
def _concat(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    axis = int(m.rng.integers(1, len(t.shape))) if len(t.shape) > 1 else 0
    branch = m.op("Tanh", [t.name])
    shape = list(t.shape)
    shape[axis] *= 2
    return Tensor(m.op("Concat", [t.name, branch], axis=axis), tuple(shape))


@grower("matmul")
def _matmul(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    k, n = t.shape[-1], int(m.rng.integers(2, 9))
    if len(t.shape) == 2 and m.rng.random() < 0.5:
        trans_b = int(m.rng.integers(2))
        w = m.param((n, k) if trans_b else (k, n), 1 / np.sqrt(k))
        bias = m.param((n,) if m.rng.random() < 0.5 else (1, n), 0.1)
        return Tensor(m.op("Gemm", [t.name, w, bias], transB=trans_b, alpha=float(m.rng.choice([1.0, 0.5]))),
                  (t.shape[0], n))
    w = m.param((k, n), 1 / np.sqrt(k))
    return Tensor(m.op("MatMul", [t.name, w]), (*t.shape[:-1], n))


@grower("conv")
def _conv(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
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
    return Tensor(out, (n, out_c, size(h), size(w)))


@grower("pool")
def _pool(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    if len(t.shape) != 4 or min(t.shape[2:]) < 2:
        return None
    kind = int(m.rng.integers(3))
    if kind == 2:
        return Tensor(m.op("GlobalAveragePool", [t.name]), (*t.shape[:2], 1, 1))
    k, stride, pad = (2, 2, 0) if m.rng.random() < 0.5 else (3, 1, 1)
    if min(t.shape[2:]) + 2 * pad < k:
        return None
    op = "MaxPool" if kind == 0 else "AveragePool"
    attrs = {"kernel_shape": [k, k], "strides": [stride, stride], "pads": [pad] * 4}
    if op == "AveragePool":
        attrs["count_include_pad"] = int(m.rng.integers(2))
    out = m.op(op, [t.name], **attrs)
    size = lambda d: (d + 2 * pad - k) // stride + 1  # noqa: E731
    return Tensor(out, (*t.shape[:2], size(t.shape[2]), size(t.shape[3])))


@grower("batchnorm")
def _batchnorm(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """BatchNormalization over axis 1 of a rank-3 or rank-4 tensor (eval mode in the file; `batchnorm=train`
    of the fuzzer's MODES trains it on the batch's statistics)."""
    if len(t.shape) not in (3, 4):
        return None
    c = t.shape[1]
    stats = [m.param((c,), 0.1), m.param((c,), 0.1), m.param((c,), 0.2), m.param((c,), 0.5, positive=True)]
    return Tensor(m.op("BatchNormalization", [t.name, *stats]), t.shape)


@grower("normalize")
def _normalize(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    if m.rng.random() < 0.5:
        axis = int(m.rng.integers(1, len(t.shape))) if len(t.shape) > 1 else -1
        return Tensor(m.op("Softmax", [t.name], axis=axis), t.shape)
    width = t.shape[-1]
    return Tensor(m.op("LayerNormalization", [t.name, m.param((width,), 0.5, positive=True), m.param((width,), 0.1)],
                   axis=-1), t.shape)


@grower("reduce")
def _reduce(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    if len(t.shape) < 3:
        return None
    axis = int(m.rng.integers(1, len(t.shape)))
    op = str(m.rng.choice(["ReduceSum", "ReduceMean", "ReduceMax"]))
    out = m.op(op, [t.name, m.ints([axis])], keepdims=1)
    return Tensor(out, tuple(1 if i == axis else d for i, d in enumerate(t.shape)))


@grower("transpose")
def _transpose(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    if len(t.shape) < 3:
        return None
    rest = [int(a) for a in m.rng.permutation(np.arange(1, len(t.shape)))]
    perm = [0] + rest
    return Tensor(m.op("Transpose", [t.name], perm=perm), tuple(t.shape[a] for a in perm))


@grower("reshape")
def _reshape(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
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
    return Tensor(m.op("Reshape", [t.name, m.ints([0] + target[1:])]), tuple(target))


@grower("slice")
def _slice(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    axes = [a for a in range(1, len(t.shape)) if t.shape[a] >= 3]
    if not axes:
        return None
    axis = axes[m.rng.integers(len(axes))]
    length = t.shape[axis]
    start, step = int(m.rng.integers(0, length // 2)), int(m.rng.choice([1, 1, 2]))
    end = int(m.rng.integers(start + 1, length + 1))
    out = m.op("Slice", [t.name, m.ints([start]), m.ints([end]), m.ints([axis]), m.ints([step])])
    return Tensor(out, tuple(len(range(start, end, step)) if a == axis else d for a, d in enumerate(t.shape)))


def _unsqueezed(m: Maker, t: Tensor) -> tuple[Tensor, int] | None:
    """A new axis of 1 after the batch axis (and where it is); None at rank 4."""
    if len(t.shape) >= 4:
        return None
    axis = int(m.rng.integers(1, len(t.shape) + 1))
    return Tensor(m.op("Unsqueeze", [t.name, m.ints([axis])]), (*t.shape[:axis], 1, *t.shape[axis:])), axis


@grower("unsqueeze")
def _unsqueeze(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Unsqueeze, and half the time Squeeze back."""
    if (up := _unsqueezed(m, t)) is None:
        return None
    if m.rng.random() < 0.5:
        return up[0]
    return Tensor(m.op("Squeeze", [up[0].name, m.ints([up[1]])]), t.shape)


@grower("pad")
def _pad(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    if len(t.shape) < 3:
        return None
    before = [0, 0] + [int(m.rng.integers(0, 2)) for _ in t.shape[2:]]
    after = [0, 0] + [int(m.rng.integers(0, 2)) for _ in t.shape[2:]]
    out = m.op("Pad", [t.name, m.ints(before + after)], mode="constant")
    return Tensor(out, tuple(d + b + a for d, b, a in zip(t.shape, before, after)))


@grower("gather")
def _gather(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Gather or GatherElements along an axis with constant indices: repeated, negative, any order."""
    if len(t.shape) < 2:
        return None
    axis = int(m.rng.integers(1, len(t.shape)))
    length, taken = t.shape[axis], int(m.rng.integers(1, t.shape[axis] + 3))
    shape = (*t.shape[:axis], taken, *t.shape[axis + 1:])
    if m.rng.random() < 0.5:
        return Tensor(m.op("Gather", [t.name, m.ints(m.rng.integers(-length, length, taken))], axis=axis), shape)
    return Tensor(m.op("GatherElements", [t.name, m.ints(m.rng.integers(-length, length, shape))], axis=axis), shape)


@grower("select")
def _select(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Where with a constant mask between the tensor and a parameter (both get a gradient)."""
    mask = m.constant(m.rng.random(_broadcast_shape(m, t.shape)) < 0.5)
    other = m.param(_broadcast_shape(m, t.shape), 0.5)
    inputs = [mask, t.name, other] if m.rng.random() < 0.5 else [mask, other, t.name]
    return Tensor(m.op("Where", inputs), t.shape)


@grower("expand")
def _expand(m: Maker, t: Tensor, live: list[Tensor]) -> Tensor | None:
    """Unsqueeze an axis and Expand it to 2 or 3 copies (a broadcast whose gradient sums them)."""
    if (up := _unsqueezed(m, t)) is None:
        return None
    shape = tuple(int(m.rng.integers(2, 4)) if a == up[1] else d for a, d in enumerate(up[0].shape))
    return Tensor(m.op("Expand", [up[0].name, m.ints(shape)]), shape)


def _dense_start(m: Maker, batch: int) -> Tensor:
    rank = int(m.rng.choice([2, 3, 4, 4]))
    shape = (batch, *(int(m.rng.integers(2, 8)) for _ in range(rank - 1)))
    m.inputs.append(GraphInput("x", shape, "float"))
    return Tensor("x", shape)


#: how a graph begins: a float input, or token ids through an embedding
STARTS: dict[str, Callable[[Maker, int], Tensor]] = {"dense": _dense_start, "tokens": token_start}
ELEMENT_TYPES = {"float": TensorProto.FLOAT, "ids": TensorProto.INT64, "mask": TensorProto.INT64}


#: growers with parameters, one of which starts every graph
PARAMETRIC = ("binary", "matmul", "conv", "conv_transpose")


def random_graph(seed: int, depth: tuple[int, int] = (2, 7), conv_site: bool = False,
                 batchnorm: bool = False) -> RandomGraph:
    """One random classifier (see the module docstring); the same seed gives the same graph. `conv_site`: a
    dense rank-4 input whose first op is a Conv of groups 1 (a site for the Conv adapters); `batchnorm`: a
    BatchNormalization right after the start (for a mode that trains it on the batch's statistics)."""
    rng = np.random.default_rng(seed)
    m = Maker(rng)
    batch = int(rng.integers(2, 4))
    start = "dense" if conv_site else str(rng.choice(sorted(STARTS), p=[0.7, 0.3]))
    t = STARTS[start](m, batch)
    if conv_site:
        t = _conv_site(m, batch)
    if batchnorm:
        t = _batchnorm(m, t if len(t.shape) > 2 else _unsqueezed(m, t)[0], []) or t  # type: ignore[index]
    if start == "tokens" and rng.random() < 0.7:  # a transformer's first block: masked attention over the tokens
        t = GROWERS["attention"](m, t, []) or t
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


def _conv_site(m: Maker, batch: int) -> Tensor:
    """A rank-4 float input `x` (replacing the drawn one) and a 1x1 Conv of groups 1 on it, >= 2 channels each side."""
    m.inputs.clear()
    shape = (batch, int(m.rng.integers(2, 6)), int(m.rng.integers(3, 7)), int(m.rng.integers(3, 7)))
    m.inputs.append(GraphInput("x", shape, "float"))
    c, k = shape[1], 1  # pointwise: a site under every --adapter-sites selection (auto: pointwise beside depthwise)
    out_c = int(m.rng.integers(2, 7))
    out = m.op("Conv", ["x", m.param((out_c, c, k, k), 1 / np.sqrt(c * k * k)), m.param((out_c,), 0.1)],
               kernel_shape=[k, k], pads=[k // 2] * 4)
    out = Tensor(out, (batch, out_c, *shape[2:]))
    return _batchnorm(m, out, []) if m.rng.random() < 0.5 else out  # a Conv-BN site: BatchNorm folded
