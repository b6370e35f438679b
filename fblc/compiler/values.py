"""Small facts about onnx_ir values and nodes: static shapes, constants, attributes."""

from __future__ import annotations

import math
from typing import Any, Collection, Sequence

import numpy as np
import onnx_ir as ir

from fblc.errors import ShapeError, UnsupportedOpError

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16})


def static_shape(value: ir.Value) -> tuple[int, ...]:
    """The shape of `value` as ints; every value has one after import."""
    shape = value.shape
    if shape is None or not shape.is_static():
        raise ShapeError(
            f"tensor '{value.name}' has no static shape ({shape})",
            "pass --input-shape NAME=DIMS for every dynamic model input",
        )
    return tuple(int(d) for d in shape)


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def is_float(value: ir.Value) -> bool:
    return value.dtype in FLOAT_TYPES


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents (initializer or Constant output), else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        attr = producer.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
    return None


def ints_input(node: ir.Node, index: int, what: str) -> list[int] | None:
    """A constant int64 input (axes, pads, shape), or None when absent."""
    if index >= len(node.inputs) or node.inputs[index] is None:
        return None
    array = const_array(node.inputs[index])
    if array is None:
        raise ShapeError(
            f"node '{node.name}' ({node.op_type}): input {index} ({what}) is not a constant",
            "fblc needs static shapes; fix dynamic dims with --input-shape",
        )
    return [int(v) for v in np.asarray(array).reshape(-1)]


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    found = node.attributes.get(name)
    return default if found is None else found.value


def choice_attr(node: ir.Node, name: str, default: str, choices: Collection[str], refused_by: str) -> str:
    """String attribute `name` of `node`, which must be one of `choices`; otherwise the
    unsupported-op error of `refused_by` (e.g. "gradient rule", "kernel") names the node."""
    value = attr(node, name, default)
    value = value.decode() if isinstance(value, bytes) else str(value)
    if value not in choices:
        raise UnsupportedOpError(f"{node.op_type} with {name}='{value}' (node '{node.name}') has no {refused_by}",
                                 f"supported: {name} in {sorted(choices)}", ops=[node.op_type])
    return value


def slice_bounds(node: ir.Node) -> tuple[list[int], list[int], list[int]]:
    """Per axis of a Slice node's input: start, stop and step, normalised like numpy's slice.indices."""
    shape = static_shape(node.inputs[0])
    rank = len(shape)
    starts = ints_input(node, 1, "starts") or []
    ends = ints_input(node, 2, "ends") or []
    axes = ints_input(node, 3, "axes") or list(range(len(starts)))
    steps = ints_input(node, 4, "steps") or [1] * len(starts)
    full = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps):
        full[axis % rank] = slice(start, end, step)
    resolved = [s.indices(n) for s, n in zip(full, shape)]
    return [r[0] for r in resolved], [r[1] for r in resolved], [r[2] for r in resolved]
