"""The benchmark scripts still run: each on its smallest case, its table checked for figures that can be.

benchmarks/instructions.py on examples/mlp.py's MLP (two steps under oclgrind, about 3 s), with
fblc/tools/kernel_stats.py's image reads from the IR against oclgrind's; kernel_stats (benchmarks/phone_kernels.py's
figures) on a hand-made kernel and bundle whose answers are counted by hand.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import pytest

from fblc.profiles import load_profile

#: multiply-adds of the MLP's forward pass, [8, 32] through 32 -> 64 -> 64 -> 10
MLP_FORWARD_MACS = 8 * (32 * 64 + 64 * 64 + 64 * 10)


def test_instruction_counts_print_a_table_of_both_layouts(capsys) -> None:
    """The step's FMAs are its contractions' multiply-adds whichever layout holds them (the forward's
    and the two backward products', so between 1x and 4x the forward's); every kernel reads and
    writes images; the last column is naive / rtile; fblc/tools/kernel_stats.py's image reads, counted
    from the kernel IR without running it, are oclgrind's within 2 % (an upper estimate: ifs are taken)."""
    if shutil.which("oclgrind") is None:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail("oclgrind is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip("oclgrind (apt-get install oclgrind) is missing")
    from benchmarks import instructions

    assert instructions.main(["--models", "mlp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "one training step under oclgrind, compiled for adreno830", lines
    rows = {}
    for line in lines[2:]:
        row = re.fullmatch(r"mlp B=8 +(\D+?) +([\d,.]+) +([\d,.]+) +([\d.]+|-)", line)
        assert row, line
        figure, naive, rtile, ratio = row.groups()
        rows[figure] = (float(naive.replace(",", "")), float(rtile.replace(",", "")), ratio)
    assert list(rows) == list(instructions.FIGURES) + [instructions.IR_READS] + list(instructions.RATIOS), lines
    naive_fmas, rtile_fmas, _ = rows["FMAs"]
    assert naive_fmas == rtile_fmas and MLP_FORWARD_MACS <= rtile_fmas <= 4 * MLP_FORWARD_MACS, rows["FMAs"]
    for figure in ("image reads", "image writes", "float add/mul/div"):
        naive, rtile, ratio = rows[figure]
        assert naive > 0 and rtile > 0 and float(ratio) == pytest.approx(naive / rtile, abs=0.006), (figure, ratio)
    for layout in (0, 1):  # kernel_stats' reads from the IR (ifs counted as taken) are oclgrind's within 2 %
        assert rows["image reads"][layout] <= rows[instructions.IR_READS][layout] <= 1.02 * rows["image reads"][layout]
    for layout in (0, 1):  # a ratio row is its two figures' quotient (printed to 3 decimals)
        assert rows["image reads per FMA"][layout] == pytest.approx(
            rows["image reads"][layout] / rows["FMAs"][layout], abs=0.0006), rows


def _hand_made_kernel() -> Any:
    """Eight texel fetches, four of which use their whole texel: `whole` (stored as a float4), the middle texel
    of two windows at one shift, `every` (its lanes picked by a 4-trip loop inside its scope) and the one stored
    by work-items 0..2 alone; `one` gives only .y, the outer window texels one side of a window each, the one in
    a `?:` branch that work-items 0..3 take only .x. Float
    lane-operations: the float4 product (4), `acc +=` (1, 4 trips); half: a product and `hacc +=` (2, in a
    3-trip loop)."""
    from fblc.codegen import ir as kir
    from fblc.texel_layout import flat_layout

    def argument(role: str, index: int) -> kir.Argument:
        return kir.Argument(role, index, "float", "float4", flat_layout(4, 64))

    block = kir.Block(kir.Numbering())
    t = block.let(kir.call("get_global_id", 0, dtype=kir.INT), "t")
    whole = block.let(kir.Load(argument("in", 0), t), "H")
    one = block.let(kir.Load(argument("in", 1), t), "H")
    every = block.let(kir.Load(argument("in", 2), t), "H")
    acc = block.mutable(kir.const(0.0), "acc", kir.FLOAT)
    hacc = block.mutable(kir.const(0.0, kir.HALF), "hacc", kir.HALF)
    with block.loop("lane", 0, 4) as (lane, body):
        body.assign(acc, kir.Lane(every, lane), "+=")
    with block.loop("k", 0, 3) as (k, body):
        q = body.let(t * 4 + k, "q")
        texels = [body.let(kir.Load(argument("in", 3), q + n), "T") for n in range(3)]
        shift = body.let(k & 3, "s")
        windows = [body.let(kir.call("window4", texels[n], texels[n + 1], shift, dtype=kir.FLOAT4), "W")
                   for n in range(2)]
        product = body.let(kir.Binary("*", kir.Cast(kir.HALF, kir.Lane(windows[0], kir.const(0))),
                                      kir.Cast(kir.HALF, kir.Lane(windows[1], kir.const(0))), kir.HALF), "p")
        body.assign(hacc, product, "+=")
    with block.when(t.lt(3)) as edge:  # work-items 0, 1, 2 of 10 take it
        edge.add(kir.Store(argument("out", 2), t, kir.Load(argument("in", 0), t + 1)))
    block.add(kir.Store(argument("out", 0), t, whole * 2.0))
    chosen = kir.select(t.lt(4), kir.Lane(kir.Load(argument("in", 1), t + 2), kir.const(0)), 0.0)  # fetched by 0..3
    block.add(kir.Store(argument("out", 1), t, kir.vector(kir.FLOAT4, acc, kir.Lane(one, kir.const(1)),
                                                          kir.Cast(kir.FLOAT, hacc), chosen)))
    return kir.KernelIR("hand_made", [argument("out", n) for n in range(3)] +
                        [argument("in", n) for n in range(4)], block.statements)


def test_kernel_stats_counts_whole_texel_fetches_and_half_arithmetic_of_a_hand_made_kernel() -> None:
    """fblc.tools.kernel_stats (benchmarks/phone_kernels.py's figures) on a kernel whose answers are counted by
    hand (_hand_made_kernel): per site 4 of 8 fetches whole; per step over 10 work-items 53 of 127 (the three
    window texels run 3 times, the if's fetch 3 times, the ?:'s 4 times); arithmetic 80 float and 60 half
    lane-operations per step."""
    from fblc.tools import kernel_stats

    figures = kernel_stats.kernel_figures(_hand_made_kernel(), items=10)
    assert (figures.fetches, figures.whole_fetches) == (8, 4)
    assert (figures.fetch_runs, figures.whole_fetch_runs) == (127, 53)
    assert figures.whole_share(weighted=True) == pytest.approx(53 / 127)
    assert dict(figures.ops) == {"float": 5, "half": 2}
    assert dict(figures.op_runs) == {"float": 80, "half": 60}
    assert figures.half_share() == pytest.approx(60 / 140) and figures.unbounded_loops == 0
    assert figures.estimated_fetch_runs == 0  # constant loops and conditions on the work-item: all exact


def test_kernel_stats_bounds_loop_trips_and_reads_a_bundle(tmp_path) -> None:
    """A loop's trips from interval bounds (`max(0, -y) .. min(3, 97 - y)`: 3; a tree's `s = 32; s > 0;
    s >>= 1`: 6); the bundle figures from a hand-made plan.json and report.json; the device's size from the
    profile's compute_units x waves_per_unit x wave_size."""
    import json

    from fblc.codegen import ir as kir
    from fblc.tools import kernel_stats, lane_use

    y = kir.Var("y", 1, kir.INT)
    window = kir.For(kir.Var("k", 2, kir.INT), kir.call("max", 0, -y), kir.call("min", 3, 97 - y), [])
    tree = kir.For(kir.Var("s", 3, kir.INT), kir.const(32), None, [], 1, condition=kir.Var("s", 3, kir.INT).gt(0),
                   step_op=">>=")
    assert lane_use.trip_count(window, {}) == 3 and lane_use.trip_count(tree, {}) == 6
    (tmp_path / "plan.json").write_text(json.dumps({"kernels": [{"name": "k0", "items": 100},
                                                               {"name": "k1", "items": 5000}]}))
    (tmp_path / "report.json").write_text(json.dumps({"estimate": {
        "kernels": [{"kernel": "k0", "flops": 30}, {"kernel": "k1", "flops": 70}], "bytes": 64, "step_ms": 0.5,
        "flops": 100}}))
    figures = kernel_stats.bundle_figures(str(tmp_path), resident_items=1536)
    assert figures == {"launches": 2, "small_launches": 1, "small_flop_share": 0.3, "bytes": 64, "step_ms": 0.5,
                       "flops": 100}
    assert kernel_stats.device_items(load_profile("adreno830")) == (1536, "profile (6 units x 4 waves x 64)")


def test_step_time_names_its_model_groups() -> None:
    """benchmarks/step_time.py --models: group names expand in order (the benchmarks' own five, then the
    architectures in no other benchmark), each model once; an unknown name is refused with the choices."""
    from benchmarks import step_time

    assert step_time.model_names("all") == list(step_time.BENCHMARKS) + list(step_time.UNSEEN)
    assert step_time.model_names("gpt2,unseen") == ["gpt2"] + [name for name in step_time.UNSEEN if name != "gpt2"]
    assert step_time.model_names("zoo") == step_time.model_names("unseen")
    assert {"resnet4", "convnext", "bert", "gpt2", "vit", "distilbert", "mobilevit", "efficientnet",
            "swin"} <= set(step_time.UNSEEN)
    with pytest.raises(SystemExit, match="no model 'resnet9'.*unseen"):
        step_time.model_names("mlp,resnet9")
