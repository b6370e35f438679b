"""`fblc verify`: one step on the OpenCL device against onnxruntime's run of the same step graph.

Both sides start from the same parameters and optimizer state and see the same batch; the
loss, every `P.grad`, `P.new` and `S.new` must agree within the tolerance of the dtype.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import onnx_ir as ir

from fblc.codegen.compile import compile_model
from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.model_io import save_model_atomically
from fblc.compiler.reference import ReferenceStep
from fblc.compiler.values import static_shape
from fblc.passes.pipeline import TrainingOptions

TOLERANCES = {"fp32": (1e-4, 1e-5), "fp16": (1e-2, 1e-3)}  # (rtol, atol)


@dataclass
class Comparison:
    name: str
    max_abs: float
    max_rel: float
    ok: bool


def _index_bound(value: ir.Value, graph: ir.Graph) -> int:
    """A safe exclusive upper bound for integer feeds: classes for labels, table rows for Gather indices."""
    bounds = []
    for use in value.uses():
        node = use.node
        if node.op_type == "Gather" and use.idx == 1:
            bounds.append(static_shape(node.inputs[0])[int(node.attributes["axis"].value) if "axis" in node.attributes else 0])
        elif node.op_type in ("Equal", "Where", "Unsqueeze", "GatherElements"):
            for out in node.outputs:
                bounds.append(_index_bound(out, graph))
    if keys.get_role(value) == Role.LABEL.value and graph.outputs:
        for node in graph:
            if node.op_type == "LogSoftmax":
                bounds.append(static_shape(node.inputs[0])[-1])
    return min([b for b in bounds if b > 0], default=2)


def random_feeds(step: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch that fits the step's inputs: normal floats, in-range integers."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in step.graph.inputs:
        if keys.get_role(value) not in (Role.INPUT.value, Role.LABEL.value):
            continue
        shape = static_shape(value)
        if value.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE):
            feeds[value.name] = rng.standard_normal(shape).astype(ir.DataType(value.dtype).numpy())
        else:
            feeds[value.name] = rng.integers(0, _index_bound(value, step.graph), shape).astype(
                ir.DataType(value.dtype).numpy())
    return feeds


def compare(device_values: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], dtype: str) -> list[Comparison]:
    rtol, atol = TOLERANCES[dtype]
    rows = []
    for name, expected in reference.items():
        got = np.asarray(device_values[name], dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        if got.shape != expected.shape:
            rows.append(Comparison(f"{name} (shape {list(got.shape)} != {list(expected.shape)})", float("inf"),
                                   float("inf"), False))
            continue
        diff = np.abs(got - expected)
        rows.append(Comparison(name, float(diff.max(initial=0.0)),
                               float((diff / np.maximum(np.abs(expected), 1e-12)).max(initial=0.0)),
                               bool(np.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=False))))
    return rows


def verify_model(model_path: str, options: TrainingOptions, target: str = "local", dtype: str = "fp32",
                 device: str | None = None, feeds: Mapping[str, np.ndarray] | None = None,
                 work_dir: str | None = None) -> list[Comparison]:
    """Compile, run one step on the device and on onnxruntime, compare every output of the step."""
    from fblc.runtime.local import LocalRunner

    with tempfile.TemporaryDirectory(dir=work_dir) as scratch:
        bundle = os.path.join(scratch, "bundle")
        step, _ = compile_model(model_path, bundle, target, dtype, options)
        step_path = os.path.join(scratch, "step.onnx")
        save_model_atomically(step, step_path)
        feeds = dict(feeds) if feeds is not None else random_feeds(step)
        reference = ReferenceStep(step_path)
        reference.step(feeds)
        runner = LocalRunner(bundle, device=device)
        runner.step(feeds)
        device_values = {name: runner.read_before_swap(name) for name in reference.last}
        return compare(device_values, reference.last, dtype)
