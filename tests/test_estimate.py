"""report.json's `estimate`: each kernel's time on the target from its profile (fblc.codegen.reports).

Golden FLOP counts of the contractions and their gradients; the step is the sum of its kernels;
the roofline follows the profile (a faster peak never makes a kernel slower, and a compute-bound
kernel gets faster with it); and a simulated-cache report replaces the reads it measured.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from fblc.codegen.compile import compile_model
from fblc.compiler.flops import node_flops
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from fblc.profiles import load_profile
from tests.test_kernels_contraction import _node, conv, write_case

OPTIONS = TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1))


def _compiled(tmp_path, nodes, inits, target="adreno830"):
    path = write_case(str(tmp_path / "case.onnx"), nodes, inits)
    return compile_model(path, str(tmp_path / "bundle"), target, "fp32", OPTIONS)


def test_contraction_flops_are_two_per_multiply_add(tmp_path) -> None:
    step, report = _compiled(tmp_path, [_node("MatMul", ["a", "b"])], {"a": (16, 32), "b": (32, 8)})
    by_op = {}
    for node in step.graph:
        by_op.setdefault(node.op_type, []).append(node_flops(node))
    # the forward [16,32]x[32,8] and the two gradients dA = dY B^T, dB = A^T dY: 2 x 16 x 32 x 8 each
    assert sorted(by_op["MatMul"]) == [8192, 8192, 8192]
    estimate = report["estimate"]
    assert estimate["step_ms"] == pytest.approx(sum(k["ms"] for k in estimate["kernels"]), abs=1e-3)
    assert len(estimate["kernels"]) == report["kernels"]
    assert estimate["flops"] >= 3 * 8192 and "not measured" in estimate["kind"]


def test_conv_flops_count_input_channels_and_taps(tmp_path) -> None:
    step, _ = _compiled(tmp_path, *conv((2, 4, 6, 6), (8, 2, 3, 3), group=2, pads=[1, 1, 1, 1]))
    forward = next(n for n in step.graph if n.op_type == "Conv" and not n.name.startswith("grad"))
    assert node_flops(forward) == 2 * (2 * 8 * 6 * 6) * (2 * 3 * 3)


def test_a_faster_peak_never_slows_a_kernel(tmp_path) -> None:
    from fblc.codegen.reports import estimate_object
    from fblc.codegen.plan import lower

    step, report = _compiled(tmp_path, [_node("MatMul", ["a", "b"])], {"a": (64, 256), "b": (256, 64)})
    profile = load_profile("adreno830")
    program = lower(step, profile, "fp32")
    base = estimate_object(step, program, profile)
    faster = estimate_object(step, program, dataclasses.replace(profile, peak_gflops=profile.peak_gflops * 100))
    pairs = list(zip(base["kernels"], faster["kernels"]))
    assert all(f["ms"] <= b["ms"] for b, f in pairs)
    assert any(f["ms"] < b["ms"] for b, f in pairs if b["bound"] == "compute") or \
        not any(b["bound"] == "compute" for b in base["kernels"])
    cache = {"kernels": [{"kernel": k["kernel"], "misses": 0} for k in base["kernels"]]}
    cached = estimate_object(step, program, profile, cache)
    assert cached["reads"] == "simulated cache misses" and cached["bytes"] < base["bytes"]
    stored = json.loads((tmp_path / "bundle" / "report.json").read_text())["estimate"]
    assert stored["step_ms"] == report["estimate"]["step_ms"]
