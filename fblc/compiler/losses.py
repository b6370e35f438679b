"""Losses appended after the model, by table: each builds ONNX ops from the model's first output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from fblc.errors import FblcError, ShapeError
from fblc.compiler.graph import Emitter, static_shape

IGNORE_INDEX = -100  # as torch.nn.CrossEntropyLoss: labels equal to it do not count


@dataclass(frozen=True)
class LossSpec:
    builder: Callable[[Emitter, ir.Value, "ir.Value | None"], ir.Value]
    takes_labels: bool
    label_dtype: "ir.DataType | None"  # None: the dtype of the model's output
    label_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    help: str
    #: labels that are class indices: the number of classes, from the output's shape. The runtimes refuse
    #: labels other than 0..classes-1 and IGNORE_INDEX before training: the kernels would read past the logits
    classes: Callable[[tuple[int, ...]], "int | None"] = lambda shape: None


def class_axis(logits_shape: tuple[int, ...]) -> int:
    """Where cross_entropy reads the classes: the last axis of [N, C] and [N, T, C] (a language model's
    tokens), axis 1 of [N, C, d1, ...] (PyTorch's convention for dense predictions: a segmentation map)."""
    return 1 if len(logits_shape) >= 4 else len(logits_shape) - 1


def _cross_entropy(e: Emitter, logits: ir.Value, labels: ir.Value | None) -> ir.Value:
    """Mean over counted positions of -log softmax(logits)[label], classes on `class_axis`."""
    assert labels is not None
    axis = class_axis(static_shape(logits))
    log_probs = e.op("LogSoftmax", logits, axis=axis)
    counted = e.op("Not", e.op("Equal", labels, e.const(np.array(IGNORE_INDEX, np.int64))))
    safe_labels = e.op("Where", counted, labels, e.const(np.array(0, np.int64)))
    picked = e.op("GatherElements", log_probs, e.op("Unsqueeze", safe_labels, e.ints([axis])), axis=axis)
    weights = e.op("Cast", counted, to=logits.dtype)
    total = e.op("ReduceSum", e.op("Mul", e.reshape(picked, static_shape(labels)), weights), keepdims=0)
    count = e.op("Max", e.op("ReduceSum", weights, keepdims=0), e.scalar(1.0, logits))
    return e.op("Neg", e.op("Div", total, count))


def _mse(e: Emitter, prediction: ir.Value, target: ir.Value | None) -> ir.Value:
    assert target is not None
    diff = e.op("Sub", prediction, target)
    return e.op("ReduceMean", e.op("Mul", diff, diff), keepdims=0)


def _model_output(e: Emitter, output: ir.Value, labels: ir.Value | None) -> ir.Value:
    if static_shape(output) not in ((), (1,)):
        raise ShapeError(f"--loss output needs a scalar first output, but '{output.name}' has shape "
                         f"{list(static_shape(output))}", "choose --loss cross_entropy or mse")
    return e.reshape(output, []) if static_shape(output) == (1,) else output


def _class_labels_shape(logits_shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(logits_shape) < 2:
        raise ShapeError(f"cross_entropy needs logits [N, C], [N, T, C] or [N, C, d1, ...], got "
                         f"{list(logits_shape)}", "use --loss mse or --loss output for this model")
    axis = class_axis(logits_shape)
    return logits_shape[:axis] + logits_shape[axis + 1:]


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(_cross_entropy, True, ir.DataType.INT64, _class_labels_shape,
                              "mean cross-entropy of logits [N, C], [N, T, C] or [N, C, H, W...] against int64 labels "
                              f"(label {IGNORE_INDEX} is ignored)", classes=lambda shape: shape[class_axis(shape)]),
    "mse": LossSpec(_mse, True, None, lambda shape: shape, "mean squared error against float labels of the output's shape"),
    "output": LossSpec(_model_output, False, None, lambda shape: shape, "the model's first output is already the loss"),
}


def loss_spec(name: str) -> LossSpec:
    if name not in LOSSES:
        raise FblcError(f"unknown loss '{name}'", f"choose one of: {', '.join(LOSSES)}")
    return LOSSES[name]
