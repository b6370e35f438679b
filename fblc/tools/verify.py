"""`fblc verify`: one step on the OpenCL device against onnxruntime's run of the same step graph.

Both sides start from the same parameters and optimizer state and see the same batch; the
loss, every `P.grad`, `P.new` and `S.new` must agree within the tolerance of the dtype. A forward bundle
(--trainer none) is compared output by output with onnxruntime's run of the model file itself (of the
forward step graph where --weights stores them rounded).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from fblc.codegen.compile import compile_model
from fblc.tools.traced_layouts import with_traced_reads
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc import bundle_format as fmt
from fblc.compiler.reference import ReferenceStep, random_feeds, run_model
from fblc.passes.pipeline import DEVICE_ONLY_OPS, TrainingOptions, build_training_graph
from fblc.runtime.local import LocalRunner

TOLERANCES = {"fp32": (1e-4, 1e-5), "fp16": (1e-2, 1e-3)}  # (rtol, atol)


@dataclass
class Comparison:
    name: str
    max_abs: float
    max_rel: float
    ok: bool


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


def reference_graph(step: ir.Model, model_path: str, options: TrainingOptions) -> ir.Model:
    """The ONNX step onnxruntime runs for the compiled `step`: the step itself, or where lowering wrote
    ops onnxruntime lacks (DEVICE_ONLY_OPS: an ES step's noise made on the device, sorted row scatters),
    `fblc train-graph`'s step (for ES it takes the noise as an input, which ReferenceStep feeds the same
    Philox noise)."""
    if not any(node.op_type in DEVICE_ONLY_OPS for node in step.graph):
        return step
    return build_training_graph(load_model(model_path), options)


def verify_model(model_path: str, options: TrainingOptions, target: str = "local", dtype: str = "fp32",
                 device: str | None = None, feeds: Mapping[str, np.ndarray] | None = None,
                 work_dir: str | None = None, storage: str = "image", keep_bundle: str | None = None
                 ) -> list[Comparison]:
    """Compile, run one step on the device and on onnxruntime, compare every output of the step (the
    runner's textures held as `storage`: LocalRunner's). `keep_bundle`: the folder the compiled bundle
    stays in (its kernels are the ones compared), else a temporary one."""
    with tempfile.TemporaryDirectory(dir=work_dir) as scratch:
        bundle = keep_bundle or os.path.join(scratch, "bundle")
        options = replace(options, dtype=dtype)  # the reference steps as the bundle does (loss scale)
        options = with_traced_reads(model_path, target, dtype, options, feeds, device=device)
        step, _ = compile_model(model_path, bundle, target, dtype, options)
        feeds = dict(feeds) if feeds is not None else random_feeds(step)
        runner = LocalRunner(bundle, device=device, storage=storage)
        if fmt.is_forward(runner.manifest):  # the model as its user runs it; with --weights int8/int4/fp16 the
            # step graph, whose DequantizeLinear reads the stored weights (their rounding is the choice of --weights)
            quantized = options.weights.weights != "fp32"
            reference = ir.to_proto(reference_graph(step, model_path, options)) if quantized else onnx.load(model_path)
            return compare(runner.infer(feeds), run_model(reference, feeds), dtype)
        step_path = os.path.join(scratch, "step.onnx")
        save_model_atomically(reference_graph(step, model_path, options), step_path)
        reference = ReferenceStep(step_path)
        reference.step(feeds)
        runner.step(feeds)
        device_values = {name: runner.read_before_swap(name) for name in reference.last}
        return compare(device_values, reference.last, dtype)
