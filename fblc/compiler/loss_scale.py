"""Dynamic loss scaling for half-precision activation gradients, in the step graph.

The backward starts from dL/dloss = S (the state `loss_scale`) instead of 1, so the activation
gradients, stored in half textures under --dtype fp16, sit S times above half's underflow; each
parameter gradient is divided by S again before the optimizer reads it (`P.grad` is the true
gradient). When any parameter gradient is not finite, the step is skipped: every `.new` state
keeps its input, and S halves; after GROWTH_INTERVAL finite steps in a row S doubles. These are
torch.cuda.amp.GradScaler's rules and defaults but for the first scale, 2^10 instead of 2^16: a
first step's gradients of order 64 then do not overflow half (max 65504) and skip the step a
user compares with fp32, while half's underflow (6e-8) still moves to 6e-11. The step reports
`scale` (the S it used) and `skipped` (1 when it made no update) beside the loss.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fblc import choices
from fblc.compiler import keys
from fblc.compiler.graph import Emitter
from fblc.compiler.keys import Role
from fblc.errors import FblcError

LOSS_SCALES = choices.LOSS_SCALES
SCALE = "loss_scale"  # the state input, and the metric output of the scale a step used
GOOD_STEPS = "loss_scale.good_steps"  # finite steps since the scale last changed
SKIPPED = "skipped"  # the metric output: 1.0 when the step's gradients were not finite
INITIAL_SCALE = 2.0**10
GROWTH, BACKOFF = 2.0, 0.5
GROWTH_INTERVAL = 2000


def uses_loss_scale(mode: str, dtype: str, trainer: str) -> bool:
    """Whether the step scales its loss: `auto` under --dtype fp16 with backpropagation."""
    if mode not in LOSS_SCALES:
        raise FblcError(f"unknown --loss-scale '{mode}'", f"choose one of: {', '.join(LOSS_SCALES)}")
    if mode == "dynamic" and trainer != "backprop":
        raise FblcError(f"--loss-scale dynamic scales the gradients of the backward, which --trainer {trainer} "
                        "does not compute", "leave --loss-scale at auto or none")
    return mode == "dynamic" or (mode == "auto" and dtype == "fp16" and trainer == "backprop")


def _state(graph: ir.Graph, name: str, initial: float) -> ir.Value:
    """A scalar fp32 state input (role opt_state) with its initializer."""
    value = ir.Value(name=name, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=ir.tensor(np.array(initial, np.float32), name=name))
    keys.set_role(value, Role.OPT_STATE)
    graph.inputs.append(value)
    graph.register_initializer(value)
    return value


def scale_input(graph: ir.Graph) -> ir.Value:
    """The state `loss_scale` (the backward's seed), added to the step's inputs."""
    return _state(graph, SCALE, INITIAL_SCALE)


def unscale(graph: ir.Graph, grads: list[ir.Value], scale: ir.Value) -> list[ir.Value]:
    """Each gradient of the scaled loss over the scale, in the optimizer stage (so stored in fp32). A Div
    reading the scale, not a Mul by one Reciprocal: each joins its gradient's kernel and 1 / scale needs no
    launch of its own (the scale is a power of two: both are exact). A gradient of another type than the
    scale's is multiplied by 1 / scale cast to it (the scale itself may lie beyond half's range)."""
    e = Emitter(graph, stage="optimizer")
    inverse = None if all(g.dtype == scale.dtype for g in grads) else e.op("Reciprocal", scale)
    return [e.op("Div", g, scale) if g.dtype == scale.dtype else e.op("Mul", g, e.op("Cast", inverse, to=g.dtype))
            for g in grads]


def _tree_sum(e: Emitter, values: list[ir.Value]) -> ir.Value:
    """Pairwise sums (binary Adds: the fuse pass bounds how many a kernel reads)."""
    while len(values) > 1:
        values = [e.op("Add", a, b) for a, b in zip(values[::2], values[1::2])] + values[len(values) - len(values) % 2:]
    return values[0]


def not_finite(e: Emitter, grads: list[ir.Value], together: list[list[ir.Value]] | None = None) -> ir.Value:
    """A boolean scalar: some element of `grads` is inf or NaN. The sum of every element is then inf
    or NaN too (a finite gradient's sum stays far below fp32's 3.4e38), and sum * 0 is NaN exactly
    then; the reductions read the gradients where they are, nothing of their size is made. Each list of
    `together` (gradients of one shape, of `grads`) is summed elementwise first and reduced once: the sum of
    every element is the same, and the elementwise Add joins the kernel that makes them all (BatchNorm's
    dgamma and dbeta), so the check reads one texture of theirs, not each (it reads at most READ_IMAGE_ARGS
    a launch)."""
    summed = {id(g) for group in together or [] for g in group}
    probes = [e.op("ReduceSum", _elementwise_sum(e, group), keepdims=0) for group in together or []]
    probes += [e.op("ReduceSum", g, keepdims=0) for g in grads if id(g) not in summed]
    probes = [p if p.dtype == ir.DataType.FLOAT else e.op("Cast", p, to=ir.DataType.FLOAT) for p in probes]
    total = _tree_sum(e, probes)
    return e.op("IsNaN", e.op("Mul", total, e.scalar(0.0, total)))


def _elementwise_sum(e: Emitter, values: list[ir.Value]) -> ir.Value:
    total = values[0]
    for value in values[1:]:
        total = e.op("Add", total, value)
    return total


def next_scale(e: Emitter, graph: ir.Graph, scale: ir.Value, skipped: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(scale.new, good_steps and good_steps.new): halve on a skipped step, double after
    GROWTH_INTERVAL finite ones in a row."""
    good = _state(graph, GOOD_STEPS, 0.0)
    counted = e.op("Add", good, e.scalar(1.0, good))
    grow = e.op("GreaterOrEqual", counted, e.scalar(float(GROWTH_INTERVAL), good))
    kept_scale = e.op("Where", grow, e.op("Mul", scale, e.scalar(GROWTH, scale)), scale)
    new_scale = e.op("Where", skipped, e.op("Mul", scale, e.scalar(BACKOFF, scale)), kept_scale)
    zero = e.scalar(0.0, good)
    new_good = e.op("Where", skipped, zero, e.op("Where", grow, zero, counted))
    return new_scale, good, new_good
