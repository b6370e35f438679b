"""Evolution strategies (ES) as ONNX: antithetic members, rewards and the update direction.

One ES step, for P antithetic pairs, relative perturbation sigma and the trainable parameters
theta (flattened and concatenated in input order, D values; under FuRA-S just `fura_s.delta`):

    members      theta_i+ = theta + sigma eps_i,  theta_i- = theta - sigma eps_i    eps = noise [P, D]
    rewards      r = [r_1+ .. r_P+, r_1- .. r_P-]  (2P), from each member's forward and loss
    z-scores     z = (r - mean r) / std r          (0 when the rewards agree to 1e-6 of their size)
    direction    g = (1 / 2P) sum_i (z_i+ - z_i-) eps_i                                   [D]
    gradient     theta.grad = -sigma g

so the optimizer's step p - lr * grad moves theta by lr * sigma * g with SGD (ES at Scale's
update, alpha = lr), and ZO-Adam is Adam on the same gradient. The unperturbed model's loss
stays the step's `loss`. Rewards (REWARDS): `neg-loss` is -loss; `accuracy` the fraction of
counted labels whose class is the arg-max of the model's output; `external`: an input, which the
application computes from the outputs `member_1 .. member_2P` (runtime.LocalRunner's `reward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx_ir as ir

from fblc import choices
from fblc.compiler import keys
from fblc.compiler.graph import Emitter, clone_node, static_shape
from fblc.compiler.losses import IGNORE_INDEX, class_axis
from fblc.errors import FblcError

TRAINERS = choices.TRAINERS
NOISE = "noise"
#: the device's ES iteration counter (a float32 scalar state; pass es_noise)
ITERATION = "es.iteration"
REWARDS_OUTPUT = "rewards"
REWARD_MEAN = "reward_mean"
#: rewards that agree to this fraction of their largest magnitude count as equal: z = 0, no step
AGREEMENT = 1e-6


@dataclass(frozen=True)
class EsConfig:
    """ES's figures; the defaults are MobileSpec's (fblc.choices says where they come from)."""

    pairs: int = choices.ES_PAIRS
    sigma: float = choices.ES_SIGMA
    reward: str = choices.ES_REWARD
    #: seed of the device's Philox noise (fblc.compiler.philox)
    seed: int = 0
    #: build the 2P members as one member forward that a loop of the kernel plan repeats (fblc.compiler.es_loop;
    #: `fblc compile` sets it), not 2P copies (the ONNX step onnxruntime checks: `fblc train-graph`)
    loop: bool = False

    def validate(self) -> None:
        if self.pairs < 1:
            raise FblcError(f"--pairs {self.pairs} is not a number of antithetic pairs >= 1",
                            "give e.g. --pairs 15 (the paper's)")
        if not np.isfinite(self.sigma) or self.sigma <= 0:
            raise FblcError(f"--sigma {self.sigma:g} is not a perturbation > 0", "give e.g. --sigma 0.03 (the paper's)")
        if self.reward not in REWARDS:
            raise FblcError(f"unknown reward '{self.reward}'", f"choose one of: {', '.join(REWARDS)}")


def _neg_loss(e: Emitter, loss: ir.Value, prediction: ir.Value, labels: ir.Value | None) -> ir.Value:
    return e.op("Neg", loss)


def _accuracy(e: Emitter, loss: ir.Value, prediction: ir.Value, labels: ir.Value | None) -> ir.Value:
    if labels is None or labels.dtype != ir.DataType.INT64:
        raise FblcError("--reward accuracy needs class labels", "use --loss cross_entropy, or --reward neg-loss")
    predicted = e.op("ArgMax", prediction, axis=class_axis(static_shape(prediction)), keepdims=0)
    counted = e.op("Not", e.op("Equal", labels, e.const(np.array(IGNORE_INDEX, np.int64))))
    hits = e.op("Cast", e.op("And", e.op("Equal", predicted, labels), counted), to=prediction.dtype)
    count = e.op("Max", e.op("ReduceSum", e.op("Cast", counted, to=prediction.dtype), keepdims=0),
                 e.scalar(1.0, prediction))
    return e.op("Div", e.op("ReduceSum", hits, keepdims=0), count)


RewardBuilder = Callable[[Emitter, ir.Value, ir.Value, "ir.Value | None"], ir.Value]
REWARD_BUILDERS: dict[str, RewardBuilder] = {"neg-loss": _neg_loss, "accuracy": _accuracy}
#: the rewards that read the loss alone, not the model's output: the members' loss may be chunked (chunk_loss)
LOSS_ONLY_REWARDS = ("neg-loss",)
#: the application scores the members' outputs (MobileSpec's verifiable outcomes): the step takes
#: `rewards` as an input and outputs `member_<m>`, each member's model output, for the scorer
EXTERNAL = "external"
REWARDS = (*REWARD_BUILDERS, EXTERNAL)
MEMBER_PREFIX = "member_"
MEMBER_OUTPUT = MEMBER_PREFIX + "{}"


#: what an application passes for --reward external: the 2P members' model outputs -> their 2P rewards
RewardFunction = Callable[[list[np.ndarray]], Sequence[float]]


def param_dependents(graph: ir.Graph, params: list[ir.Value]) -> list[ir.Node]:
    """The nodes that read a parameter, directly or through other nodes, in graph order."""
    tainted = {id(p) for p in params}
    nodes = []
    for node in graph:
        if any(v is not None and id(v) in tainted for v in node.inputs):
            nodes.append(node)
            tainted.update(id(v) for v in node.outputs)
    return nodes


def flat_slice(e: Emitter, vector: ir.Value, offset: int, shape: tuple[int, ...]) -> ir.Value:
    """vector[offset: offset + numel(shape)] as `shape`."""
    size = int(np.prod(shape, dtype=np.int64))
    part = e.op("Slice", vector, e.ints([offset]), e.ints([offset + size]), e.ints([0]))
    return e.reshape(part, list(shape))


def noise_row(e: Emitter, noise: ir.Value, row: int) -> ir.Value:
    width = static_shape(noise)[1]
    return e.reshape(e.op("Slice", noise, e.ints([row]), e.ints([row + 1]), e.ints([0])), [width])


def member_forward(e: Emitter, forward: list[ir.Node], params: list[ir.Value], noise: ir.Value, row: int,
                   sign: float, sigma: float, outputs: list[ir.Value]) -> list[ir.Value]:
    """`outputs` of the forward at theta + sign * sigma * noise[row]: a copy of the nodes that read a
    parameter, the rest shared."""
    eps = noise_row(e, noise, row)
    return perturbed_forward(e, forward, params, eps, e.scalar(sign * sigma, params[0]), outputs)


def perturbed_forward(e: Emitter, forward: list[ir.Node], params: list[ir.Value], eps: ir.Value, scale: ir.Value,
                      outputs: list[ir.Value]) -> list[ir.Value]:
    """`outputs` of the forward at theta + scale * eps (eps [D], scale a scalar value): a copy of the nodes that
    read a parameter, the rest shared."""
    mapping: dict[int, ir.Value] = {}
    offset = 0
    for param in params:
        shape = static_shape(param)
        step = e.op("Mul", flat_slice(e, eps, offset, shape), scale)
        mapping[id(param)] = e.op("Add", param, step)
        offset += int(np.prod(shape, dtype=np.int64))
    for node in forward:
        clone_node(e, node, mapping, stage=node.metadata_props.get(keys.STAGE, "forward"))
    return [mapping.get(id(v), v) for v in outputs]


def z_scores(e: Emitter, rewards: ir.Value) -> ir.Value:
    """(r - mean) / std over the members, 0 where the rewards agree (AGREEMENT)."""
    mean = e.op("ReduceMean", rewards, keepdims=1)
    centred = e.op("Sub", rewards, mean)
    std = e.op("Sqrt", e.op("ReduceMean", e.op("Mul", centred, centred), keepdims=1))
    size = e.op("ReduceMax", e.op("Abs", rewards), keepdims=1)
    spread = e.op("Greater", std, e.op("Mul", size, e.scalar(AGREEMENT, rewards)))
    safe = e.op("Max", std, e.scalar(1e-30, rewards))
    return e.op("Where", spread, e.op("Div", centred, safe), e.op("Mul", centred, e.scalar(0.0, rewards)))


def direction(e: Emitter, z: ir.Value, noise: ir.Value) -> ir.Value:
    """g = (1 / 2P) sum_i (z_i+ - z_i-) eps_i  [D]."""
    pairs, width = static_shape(noise)
    plus = e.op("Slice", z, e.ints([0]), e.ints([pairs]), e.ints([0]))
    minus = e.op("Slice", z, e.ints([pairs]), e.ints([2 * pairs]), e.ints([0]))
    weights = e.op("Mul", e.op("Sub", plus, minus), e.scalar(1.0 / (2 * pairs), z))
    return e.reshape(e.op("MatMul", e.reshape(weights, [1, pairs]), noise), [width])
