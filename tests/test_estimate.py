"""report.json's `estimate`: each kernel's time on the target from its profile (fblc.codegen.reports).

Golden FLOP counts of the contractions and their gradients; the step is the sum of its kernels;
the roofline follows the profile (a faster peak never makes a kernel slower, and a compute-bound
kernel gets faster with it); and a simulated-cache report replaces the reads it measured.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

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


# the roofline (fblc.profiles.roofline), figures counted by hand --------------------------------------
#: a device of 4 units x 2 waves x 32 lanes (256 lanes) whose peak of 512 GFLOP/s makes a 1 GHz clock: a
#: full device issues 256e6 lane-instructions a ms and its texture units 4 x 64 bytes a clock, 256e6 bytes a ms
DEVICE = dict(peak_gflops=512.0, device_items=256, wave_size=32, compute_units=4, texture_bytes_per_clock=64,
              bandwidth_gbps=100.0, launch_us=10.0, fp16=True, half_rate=2.0)


def _device(**changes: Any) -> Any:
    import types

    return types.SimpleNamespace(**{**DEVICE, **changes})


def test_a_full_launch_takes_its_slowest_term_plus_the_launch() -> None:
    from fblc.profiles.roofline import LaunchWork, clock_hz, launch_time

    assert clock_hz(_device()) == pytest.approx(1e9)
    full = launch_time(_device(), LaunchWork(256, 256, 64, float_slots=256e6, half_slots=256e6, fetched_bytes=128e6,
                                             dram_bytes=2e8))
    # 256e6 float slots at 256e6 a ms, 256e6 half ones at twice that; 128e6 bytes at 256e6 a ms; 2e8 bytes at 1e8
    assert (full.compute_ms, full.fetch_ms, full.dram_ms, full.launch_ms) == pytest.approx((1.5, 0.5, 2.0, 0.01))
    assert (full.lane_share, full.unit_share, full.bound, full.ms) == (1.0, 1.0, "memory", pytest.approx(2.01))
    as_float = launch_time(_device(fp16=False), LaunchWork(256, 256, 64, 256e6, 256e6, 0, 0))
    assert (as_float.compute_ms, as_float.bound) == (pytest.approx(2.0), "compute")  # no cl_khr_fp16: one rate


def test_a_launch_smaller_than_the_device_or_its_waves_uses_part_of_it() -> None:
    """Occupancy: 40 work-items in one group of 64 hold 2 waves (64 of 256 lanes, 1 of 4 units); each working
    item's operations issue for 64 / 40 lanes. Groups of 8 in waves of 32 waste 3 lanes of 4."""
    from fblc.profiles.roofline import LaunchWork, launch_time, waves

    small = launch_time(_device(), LaunchWork(40, 64, 64, 40e3, 0, 32e3, 0))
    assert (small.lane_share, small.unit_share) == (0.25, 0.25)
    assert small.compute_ms == pytest.approx(40e3 * 64 / 40 / (256e6 * 0.25))  # 1e-3 ms
    assert small.fetch_ms == pytest.approx(32e3 / (256e6 * 0.25))  # 5e-4 ms
    assert small.bound == "launch" and small.ms == pytest.approx(0.011)
    assert waves(_device(), 64, 8) == 8 and waves(_device(), 64, 64) == 2
    narrow = launch_time(_device(), LaunchWork(64, 64, 8, 64e4, 0, 0, 0))
    wide = launch_time(_device(), LaunchWork(64, 64, 64, 64e4, 0, 0, 0))
    assert narrow.compute_ms == pytest.approx(wide.compute_ms)  # 4x the lanes issued, at 4x the lanes' rate ...
    crowded = launch_time(_device(), LaunchWork(1024, 1024, 8, 1024e4, 0, 0, 0))
    packed = launch_time(_device(), LaunchWork(1024, 1024, 64, 1024e4, 0, 0, 0))
    assert crowded.compute_ms == pytest.approx(4 * packed.compute_ms)  # ... until the device is full


def test_a_kernel_that_wastes_lanes_raises_the_ir_estimate() -> None:
    """kernel_stats.ir_estimate (phone_kernels' `IR est ms`) on two hand-made kernels writing the same texels:
    one fetches each input texel whole and doubles it as a float4; the other fetches 4 texels and doubles
    each as a float4 to keep its lane x. Its fetched bytes (whole texels: 16 each) and lane-operations are 4x,
    and so is its time on adreno830 once DRAM does not bound it. A product an add takes fuses into it."""
    from fblc.codegen import ir as kir
    from fblc.texel_layout import flat_layout
    from fblc.tools import kernel_stats

    def argument(role: str) -> kir.Argument:
        return kir.Argument(role, 0, "float", "float4", flat_layout(4, 1 << 22))

    def kernel(lanes_wasted: bool) -> kir.KernelIR:
        block = kir.Block(kir.Numbering())
        t = block.let(kir.call("get_global_id", 0, dtype=kir.INT), "t")
        if lanes_wasted:
            doubled = [block.let(kir.Load(argument("in"), t * 4 + n) * 2.0, "D") for n in range(4)]
            value = kir.vector(kir.FLOAT4, *(kir.Lane(d, kir.const(0)) for d in doubled))
        else:
            value = block.let(kir.Load(argument("in"), t) * 2.0, "D")
        block.add(kir.Store(argument("out"), t, value))
        return kir.KernelIR("k", [argument("out"), argument("in")], block.statements)

    items, profile = 1 << 18, load_profile("adreno830")
    figures = {name: kernel_stats.kernel_figures(kernel(name == "wasted"), items) for name in ("whole", "wasted")}
    assert (figures["whole"].fetched_bytes_runs, figures["wasted"].fetched_bytes_runs) == (16 * items, 64 * items)
    assert (figures["whole"].op_runs["float"], figures["wasted"].op_runs["float"]) == (4 * items, 16 * items)
    plan = {"kernels": [{"name": name, "items": items, "global_size": [items], "local_size": [64]}
                        for name in figures]}
    report = {"kernels": [{"kernel": name, "bytes": 0} for name in figures]}  # data in cache: no DRAM term

    def ms(name: str) -> float:
        return kernel_stats.ir_estimate({name: figures[name]}, plan, report, profile)["ir_step_ms"]

    launch_ms = profile.launch_us * 1e-3
    assert ms("wasted") - launch_ms == pytest.approx(4 * (ms("whole") - launch_ms))
    assert kernel_stats.ir_estimate(figures, plan, report, profile)["ir_bounds"] == {"fetch": 2}
    assert not figures["whole"].fused_runs
    block = kir.Block(kir.Numbering())
    acc = block.mutable(kir.const(0.0), "acc", kir.FLOAT)
    x = block.let(kir.Lane(kir.Load(argument("in"), kir.const(0)), kir.const(0)), "x")
    block.assign(acc, x * x, "+=")  # one fused multiply-add
    block.assign(acc, x * x + x * 2.0, "+=")  # one fused (the + and one product), a product, the +=
    fused = kernel_stats.kernel_figures(kir.KernelIR("f", [argument("in")], block.statements), 10)
    assert (fused.op_runs["float"], fused.fused_runs["float"]) == (60, 20)
