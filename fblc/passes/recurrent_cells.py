"""One time step of ONNX's RNN, GRU and LSTM cells in primitive ops: the helper of lower_recurrent.

A cell reads the step's input projection `x` ([B, G*H]: X_t W^T with W's bias already added, G
gates of width H), the previous state and the direction's weights, and writes the new state with
MatMul, Add, Mul, Sub, Split, Clip and the activation ops (`ACTIVATIONS`), following the ONNX
operator definitions (gate orders: RNN i; GRU z, r, h; LSTM i, o, f, c), as onnxruntime computes
them: `clip` bounds every gate's pre-activation (after the peephole term), LSTM `input_forget`
makes f = 1 - i, GRU `linear_before_reset` applies r to (H R_h^T + Rb_h) instead of to H.

Activations are a table keyed by ONNX name (matched without case, as onnxruntime does): each
consumes alphas and betas from the node's `activation_alpha` / `activation_beta` lists in the
order of the activation list, as onnxruntime reads them, and falls back to the ONNX operator's
default when the list runs out. A name outside the table is refused, naming the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import onnx_ir as ir

from fblc.compiler.graph import Emitter
from fblc.errors import UnsupportedOpError

#: (emitter, pre-activation, alpha, beta) -> activation
Build = Callable[[Emitter, ir.Value, float, float], ir.Value]


@dataclass(frozen=True)
class Activation:
    build: Build
    alphas: int = 0  # how many values of activation_alpha it consumes
    betas: int = 0
    alpha: float = 0.0  # the ONNX operator's defaults
    beta: float = 0.0


def _plain(op: str) -> Build:
    return lambda e, x, alpha, beta: e.op(op, x)


def _affine(e: Emitter, x: ir.Value, alpha: float, beta: float) -> ir.Value:
    return e.op("Add", e.op("Mul", x, e.scalar(alpha, x)), e.scalar(beta, x))


def _scaled_tanh(e: Emitter, x: ir.Value, alpha: float, beta: float) -> ir.Value:
    return e.op("Mul", e.op("Tanh", e.op("Mul", x, e.scalar(beta, x))), e.scalar(alpha, x))


ACTIVATIONS: dict[str, Activation] = {
    "Sigmoid": Activation(_plain("Sigmoid")),
    "Tanh": Activation(_plain("Tanh")),
    "Relu": Activation(_plain("Relu")),
    "Softsign": Activation(_plain("Softsign")),
    "Softplus": Activation(_plain("Softplus")),
    "Affine": Activation(_affine, 1, 1, 1.0, 0.0),
    "ScaledTanh": Activation(_scaled_tanh, 1, 1, 1.0, 1.0),
    "LeakyRelu": Activation(lambda e, x, a, b: e.op("LeakyRelu", x, alpha=a), 1, 0, 0.01),
    "ThresholdedRelu": Activation(lambda e, x, a, b: e.op("ThresholdedRelu", x, alpha=a), 1, 0, 1.0),
    "Elu": Activation(lambda e, x, a, b: e.op("Elu", x, alpha=a), 1, 0, 1.0),
    "HardSigmoid": Activation(lambda e, x, a, b: e.op("HardSigmoid", x, alpha=a, beta=b), 1, 1, 0.2, 0.5),
}
_BY_LOWER = {name.lower(): name for name in ACTIVATIONS}

#: the activation function of one gate, bound to its alpha and beta
Act = Callable[[Emitter, ir.Value], ir.Value]


def activations(op: str, node_name: str, names: Sequence[str], alphas: Sequence[float], betas: Sequence[float]
                ) -> list[Act]:
    """The node's activation list (every direction's, in order) bound to their alphas and betas."""
    bound: list[Act] = []
    alpha_at, beta_at = 0, 0
    for name in names:
        canonical = _BY_LOWER.get(name.lower())
        if canonical is None:
            raise UnsupportedOpError(f"{op} node '{node_name}' uses activation '{name}'",
                                     f"fblc lowers {', '.join(ACTIVATIONS)}", ops=[op])
        entry = ACTIVATIONS[canonical]
        alpha = float(alphas[alpha_at]) if entry.alphas and alpha_at < len(alphas) else entry.alpha
        beta = float(betas[beta_at]) if entry.betas and beta_at < len(betas) else entry.beta
        alpha_at, beta_at = alpha_at + entry.alphas, beta_at + entry.betas
        bound.append(lambda e, x, build=entry.build, a=alpha, b=beta: build(e, x, a, b))
    return bound


@dataclass
class Weights:
    """One direction's recurrence weights: R^T [H, G*H] (split as a cell needs), the recurrent bias
    a cell adds inside a gate (GRU's Rb_h with linear_before_reset), LSTM's peepholes [H] (i, o, f)."""

    recurrent: ir.Value
    recurrent_h: ir.Value | None = None  # GRU without linear_before_reset: R_h^T [H, H] apart
    inner_bias: ir.Value | None = None
    peepholes: tuple[ir.Value, ir.Value, ir.Value] | None = None


@dataclass(frozen=True)
class CellOptions:
    hidden: int
    acts: Sequence[Act]  # this direction's activations (f, g, h as the op defines them)
    clip: float | None
    input_forget: bool = False
    linear_before_reset: bool = False


def _gates(e: Emitter, x: ir.Value, count: int, width: int) -> list[ir.Value]:
    """`count` gates of `width` columns each (Split's sizes as an input: opset 13 and later)."""
    if count == 1:
        return [x]
    return list(e.op_multi("Split", x, e.ints([width] * count), axis=1, num_outputs=count))


def _clip(e: Emitter, x: ir.Value, options: CellOptions) -> ir.Value:
    if options.clip is None:
        return x
    return e.op("Clip", x, e.scalar(-options.clip, x), e.scalar(options.clip, x))


def rnn_step(e: Emitter, x: Sequence[ir.Value], h: ir.Value, c: ir.Value | None, w: Weights, options: CellOptions
             ) -> tuple[ir.Value, ir.Value | None]:
    """Ht = f(Xt W^T + Ht-1 R^T + Wb + Rb)."""
    pre = e.op("Add", x[0], e.op("MatMul", h, w.recurrent))
    return options.acts[0](e, _clip(e, pre, options)), None


def gru_step(e: Emitter, x: Sequence[ir.Value], h: ir.Value, c: ir.Value | None, w: Weights, options: CellOptions
             ) -> tuple[ir.Value, ir.Value | None]:
    """z, r = f(..), h~ = g(Xt Wh^T + (r * Ht-1) Rh^T + Rbh + Wbh) (or r * (Ht-1 Rh^T + Rbh) with
    linear_before_reset), Ht = (1 - z) * h~ + z * Ht-1 = h~ + z * (Ht-1 - h~). The input projection comes in
    three groups, one per gate (Cell.groups): a per-step view split again would be copied, and a Split of the
    sum Xt W^T + Ht-1 R^T would end the step's elementwise kernel there."""
    f, g = options.acts[0], options.acts[1]
    xz, xr, xh = x
    if options.linear_before_reset:
        rz, rr, rh = _gates(e, e.op("MatMul", h, w.recurrent), 3, options.hidden)
        if w.inner_bias is not None:
            rh = e.op("Add", rh, w.inner_bias)
    else:
        rz, rr = _gates(e, e.op("MatMul", h, w.recurrent), 2, options.hidden)
    z = f(e, _clip(e, e.op("Add", xz, rz), options))
    r = f(e, _clip(e, e.op("Add", xr, rr), options))
    if options.linear_before_reset:
        reset = e.op("Mul", r, rh)
    else:
        assert w.recurrent_h is not None
        reset = e.op("MatMul", e.op("Mul", r, h), w.recurrent_h)
    candidate = g(e, _clip(e, e.op("Add", xh, reset), options))
    return e.op("Add", candidate, e.op("Mul", z, e.op("Sub", h, candidate))), None


def lstm_step(e: Emitter, x: Sequence[ir.Value], h: ir.Value, c: ir.Value | None, w: Weights, options: CellOptions
              ) -> tuple[ir.Value, ir.Value | None]:
    """i = f(.. + Pi * Ct-1), f = f(.. + Pf * Ct-1) (1 - i with input_forget), c~ = g(..),
    Ct = f * Ct-1 + i * c~, o = f(.. + Po * Ct), Ht = o * h(Ct)."""
    assert c is not None
    f, g, act_h = options.acts[0], options.acts[1], options.acts[2]
    pi, po, pf, pc = _gates(e, e.op("Add", x[0], e.op("MatMul", h, w.recurrent)), 4, options.hidden)
    if w.peepholes is not None:
        pi = e.op("Add", pi, e.op("Mul", c, w.peepholes[0]))
        pf = e.op("Add", pf, e.op("Mul", c, w.peepholes[2]))
    i = f(e, _clip(e, pi, options))
    forget = e.op("Sub", e.scalar(1.0, i), i) if options.input_forget else f(e, _clip(e, pf, options))
    cell = e.op("Add", e.op("Mul", forget, c), e.op("Mul", i, g(e, _clip(e, pc, options))))
    if w.peepholes is not None:
        po = e.op("Add", po, e.op("Mul", cell, w.peepholes[1]))
    o = f(e, _clip(e, po, options))
    return e.op("Mul", o, act_h(e, cell)), cell


Step = Callable[[Emitter, Sequence[ir.Value], ir.Value, "ir.Value | None", Weights, CellOptions],
                "tuple[ir.Value, ir.Value | None]"]


@dataclass(frozen=True)
class Cell:
    step: Step
    gates: int
    groups: tuple[int, ...]  # the gates of each input projection the step reads (one MatMul over all steps each)
    defaults: tuple[str, ...]  # one direction's activations when the node names none
    into: str  # the ops it writes, for docs/OPS.md
    limits: str = ("a sequence length that is not static; activations outside ACTIVATIONS (refused, naming the "
                   "node)")


_COMMON = ", Split, Transpose, Reshape, Concat; Clip (clip), Where (sequence_lens)"

CELLS: dict[str, Cell] = {
    "RNN": Cell(rnn_step, 1, (1,), ("Tanh",), f"MatMul, Add, Tanh (the activations){_COMMON}"),
    "GRU": Cell(gru_step, 3, (1, 1, 1), ("Sigmoid", "Tanh"), f"MatMul, Add, Sub, Mul, Sigmoid, Tanh (the activations){_COMMON}"),
    "LSTM": Cell(lstm_step, 4, (4,), ("Sigmoid", "Tanh", "Tanh"),
                 f"MatMul, Add, Sub, Mul, Sigmoid, Tanh (the activations){_COMMON}"),
}
