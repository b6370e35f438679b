"""Work-group staging (fblc/codegen/kernels/staging.py): which kernels stage their shared texels in __local, and how
they render. Codegen only (no device): the numbers of staged kernels are the merged steps' (test_kernels_contraction:
its texel cases' convs, transposes and MatMuls stage on the local profile, which test_merged_cases_stage checks) and
oclgrind's (tests/test_oclgrind.py: the conv net's and the MLP's kernels stage, under --data-races)."""

from __future__ import annotations

import re
import numpy as np
import pytest

from fblc.codegen import ir as kir
from fblc.codegen.kernels.item_index import evaluate
from fblc.codegen.kernels.staging import grouped_item, grouped_items
from fblc.codegen.render.opencl import BUFFER, IMAGE, render_kernel
from fblc.profiles.profile import load_profile
from tests.support.kernel_ir import lowered_kernels, profile_with
from tests.test_kernels_contraction import GROUPED_CASES, OPTIONS, TEXEL_CASES, conv, write_case


def _staged(kernels: list) -> list:
    return [k for k in kernels if any(isinstance(s, kir.Stage) for s in kir.walk(k.ir.body))]


@pytest.fixture(scope="module")
def temporal(tmp_path_factory) -> str:
    """A T-ResNet-shaped temporal conv: 8 -> 16 channels over 60 steps, 5 taps."""
    path = tmp_path_factory.mktemp("staging") / "temporal.onnx"
    return write_case(str(path), *conv((4, 8, 60, 1), (16, 8, 5, 1), pads=[2, 0, 2, 0]))


def test_a_temporal_conv_stages_its_shared_reads_where_the_profile_says_it_pays(temporal: str, tmp_path) -> None:
    """On the local profile (PoCL: local_staging) the forward conv's work-group copies the texels its work-items
    share: its kernel is written for one group size (reqd_work_group_size, the launch's group), every read of a
    staged operand has its __local twin, and the copies sit between barriers. Images render the staging, buffers
    the same kernel with plain loads. A profile without local_staging (a copy of local's, the phones') stages
    nothing."""
    kernels = lowered_kernels(temporal, options=OPTIONS)
    staged = _staged(kernels)
    forward = next(k for k in kernels if k.name.endswith("_Conv"))
    assert forward in staged, [k.name for k in kernels]
    group = forward.ir.group_size
    assert group is not None and forward.group_size == group and forward.global_size % group == 0
    arrays = {s.var for s in kir.walk(forward.ir.body) if isinstance(s, kir.DeclareArray) and s.local}
    copies = [s for s in kir.walk(forward.ir.body) if isinstance(s, kir.Stage)
              and any(isinstance(t, kir.Barrier) for t in s.then)]
    assert arrays and copies
    twins = [e for s in kir.walk(forward.ir.body) for x in kir.statement_exprs(s) for e in kir.walk_expr(x)
             if isinstance(e, kir.Load) and e.staged is not None]
    assert twins and all(isinstance(e.staged, kir.Element) and e.staged.array in arrays for e in twins)
    image, buffer = render_kernel(forward.ir, IMAGE), render_kernel(forward.ir, BUFFER)
    assert f"reqd_work_group_size({group}, 1, 1)" in image and "barrier(" in image and "__local float4" in image
    assert "barrier(" not in buffer and "__local" not in buffer
    for target in (profile_with(str(tmp_path), "local", local_staging=False), "adreno830"):
        assert not _staged(lowered_kernels(temporal, target=target, options=OPTIONS)), target


def test_merged_cases_stage(tmp_path) -> None:
    """The merged device steps run staged kernels (so their numbers check staging): a pointwise conv and its
    transpose (TEXEL_CASES' conv_1x1_w8) on the local profile."""
    nodes, inits = TEXEL_CASES["conv_1x1_w8"][:2]
    kernels = lowered_kernels(write_case(str(tmp_path / "conv_1x1_w8.onnx"), nodes, inits), options=OPTIONS)
    assert {k.name.split("_", 1)[1] for k in _staged(kernels)} >= {"Conv", "ConvTranspose"}


def test_groups_take_blocks_of_runs_where_both_operands_are_shared(tmp_path) -> None:
    """Where one operand's reads repeat in runs of items (a weight gradient's output channels of one input channel),
    a staged group takes blocks of those runs (grouped_items), so both operands are shared; the merged case
    conv_temporal_grouped_items runs these kernels on the device. grouped_item (the kernel's) is a permutation
    of the launch's items, the same as grouped_items (the plan's)."""
    nodes, inits = GROUPED_CASES["conv_temporal_grouped_items"]
    kernels = _staged(lowered_kernels(write_case(str(tmp_path / "grouped.onnx"), nodes, inits), options=OPTIONS))
    grouped = [k for k in kernels if "get_global_id(0) - lid" in render_kernel(k.ir, IMAGE)]
    assert {k.name.split("_", 1)[1] for k in grouped} == {"Conv", "ConvTranspose"}, [k.name for k in kernels]
    for k in grouped:
        staged = [s for s in kir.walk(k.ir.body) if isinstance(s, kir.DeclareArray) and s.local]
        assert len(staged) == 2, k.name
    position, lid = kir.Var("p", 0, kir.INT, "p"), kir.Var("lid", 1, kir.INT, "lid")
    for items, group, across, period in ((96, 16, 4, 8), (2048, 16, 4, 32), (288, 48, 6, 12)):
        at = np.arange(items, dtype=np.int64)
        plan = grouped_items(at, group, across, period)
        assert sorted(plan) == list(at), (items, group, across, period)
        kernel = evaluate(grouped_item(position, lid, group, across, period),
                           {lid: kir.mod_index(position, group)}, position, at)
        assert np.array_equal(kernel, plan), (items, group, across, period)


def test_groups_take_runs_a_batch_element_apart_where_the_weights_repeat(tmp_path) -> None:
    """Where the weights' reads repeat every batch element's items, a group of the size chosen may hold runs of
    items one batch element apart (more batch elements, fewer channel tiles: the weights shared by more items),
    each run's x copied as its own span (element j of run r: texel q0 + r * gap + j - r * span); the merged case
    conv_temporal_run_spans runs these kernels on the device."""
    nodes, inits = GROUPED_CASES["conv_temporal_run_spans"]
    kernels = _staged(lowered_kernels(write_case(str(tmp_path / "spans.onnx"), nodes, inits), options=OPTIONS))
    runs = re.compile(r"\(\(q\d+ \+ \(r\d+ \* \d+\)\) \+ \(j\d+ - \(r\d+ \* \d+\)\)\)")
    spans = [k for k in kernels if runs.search(render_kernel(k.ir, IMAGE))]
    assert {k.name.split("_", 1)[1] for k in spans} == {"Conv", "ConvTranspose"}, [k.name for k in kernels]
    assert all("get_global_id(0) - lid" in render_kernel(k.ir, IMAGE) for k in spans)


def test_a_staged_block_masks_each_border_element_once(tmp_path) -> None:
    """A staged block masks each border element of x once (a let its products read), not once per product: the
    selects repeated per product made PoCL spill (T-ResNet B=64's input gradient 49 -> 33 ms); the merged case
    conv_temporal_run_spans runs these kernels on the device."""
    nodes, inits = GROUPED_CASES["conv_temporal_run_spans"]
    kernels = _staged(lowered_kernels(write_case(str(tmp_path / "masks.onnx"), nodes, inits), options=OPTIONS))
    masking = set()
    for kernel in kernels:
        source = render_kernel(kernel.ir, IMAGE)
        selects = re.findall(r"\(m\d+ \? T\d+\.[xyzw] : 0\.0f\)", source)
        assert len(selects) == len(set(selects)), kernel.name
        assert not any(" ? " in line for line in source.splitlines() if "+=" in line), kernel.name
        masking |= {kernel.name.split("_", 1)[1]} if selects else set()
    assert masking == {"Conv", "ConvTranspose"}, [k.name for k in kernels]


def test_the_plan_evaluates_index_arithmetic_as_c_does() -> None:
    """The plan's evaluator of an item's index (numpy) against C's int semantics: division and remainder
    toward zero, div_index's 64-bit reciprocal multiply, arithmetic shifts of negative values."""
    item = kir.Var("g", 0, kir.INT, "g")
    items = np.arange(-50, 3000, dtype=np.int64)
    cases = [(item / 7, [int(v / 7) for v in items]), (item - (item / 7) * 7, [v - int(v / 7) * 7 for v in items]),
             (item >> 2, [v >> 2 for v in items]), (kir.call("clamp", item - 9, 0, 100), np.clip(items - 9, 0, 100))]
    nonnegative = items[items >= 0]
    cases += [(kir.div_index(item, 15), nonnegative // 15), (kir.mod_index(item, 12), nonnegative % 12)]
    for expr, expected in cases:
        at = items if len(expected) == len(items) else nonnegative
        assert np.array_equal(evaluate(expr, {}, item, at), np.asarray(expected)), expr


def test_a_nested_weight_gradient_holds_its_group_to_half_the_l1_unless_it_carries(tmp_path, monkeypatch) -> None:
    """On a CPU profile the weight gradient, whose barriers sit in the batch loop around its blocks, carries its
    accumulators (carried.py) and may take a group whose work-items' accumulators pass half of l1_bytes. Where it
    would not carry them (CARRIED_BLOCKS out of its reach), it takes a group whose accumulators fit half the L1
    (PoCL keeps them in the group's context array), and with an L1 32 times larger the larger group that reads
    fewer texels. The forward conv (one loop) keeps its group either way."""
    from fblc.codegen.kernels import carried as carried_module

    path = write_case(str(tmp_path / "wide.onnx"), *conv((2, 32, 48, 1), (32, 32, 5, 1), pads=[2, 0, 2, 0]))
    large = profile_with(str(tmp_path), "local", l1_bytes=1 << 20)
    forward, gradient = "k1_Conv", "k5_Conv"

    def groups(target: str) -> dict:
        return {k.name: k for k in _staged(lowered_kernels(path, target=target, options=OPTIONS))}

    half = load_profile("local").l1_bytes // 2
    carried = groups("local")
    assert "volatile" in render_kernel(carried[gradient].ir, IMAGE)
    monkeypatch.setattr(carried_module, "CARRIED_BLOCKS", 10 ** 9)
    kernels = {target: groups(target) for target in ("local", large)}
    accumulators = next(s for s in kir.walk(kernels["local"][gradient].ir.body)
                        if isinstance(s, kir.DeclareArray) and s.var.kind == "accv")
    live = accumulators.length * accumulators.var.dtype.lanes * 4
    assert "volatile" not in render_kernel(kernels["local"][gradient].ir, IMAGE)
    assert kernels["local"][gradient].group_size * live <= half, (kernels["local"][gradient].group_size, live)
    assert carried[gradient].group_size * live > half, (carried[gradient].group_size, live)
    assert kernels[large][gradient].group_size > kernels["local"][gradient].group_size
    assert kernels[large][forward].group_size == kernels["local"][forward].group_size == carried[forward].group_size


def test_a_reduction_of_many_staged_blocks_carries_its_slots_and_accumulators_across_the_barriers(tmp_path) -> None:
    """On a CPU profile a staged reduction of CARRIED_BLOCKS blocks or more carries a volatile zero and each gathered
    or run operand's slot as volatile ints, reads them again after each copy's barriers, and updates a block's
    accumulators as private copies taken at `acc[k + zero]` and written back (kernels/carried.py: PoCL kept 84
    hoisted pointers and 16 split accumulator arrays in its context, 4x the time); buffers render the plain
    updates. A reduction of fewer blocks, or a profile that is no CPU, carries nothing. The merged cases
    conv_temporal_grouped_items and conv_temporal_run_spans run these kernels on the device."""
    nodes, inits = GROUPED_CASES["conv_temporal_grouped_items"]
    path = write_case(str(tmp_path / "grouped.onnx"), nodes, inits)
    carried = _staged(lowered_kernels(path, options=OPTIONS))
    assert {k.name.split("_", 1)[1] for k in carried} == {"Conv", "ConvTranspose"}, [k.name for k in carried]
    for kernel in carried:
        image, buffer = render_kernel(kernel.ir, IMAGE), render_kernel(kernel.ir, BUFFER)
        volatiles = re.findall(r"volatile int (\w+) = ", image)
        zero = next(v for v in volatiles if v.startswith("zc"))
        copies = image.count("barrier(CLK_LOCAL_MEM_FENCE);") // 2
        assert len(re.findall(rf"const int z\d+ = {zero};", image)) == copies, kernel.name
        assert all(len(re.findall(rf"const int slot\d+ = {slot};", image)) == copies
                   for slot in volatiles if slot != zero), kernel.name
        assert not re.search(r"accv\d+\[\d+\](\.\w+)? \+=", image), kernel.name
        assert re.search(r"float\d* ra\d+ = accv\d+\[\(\d+ \+ z\d+\)\];", image), kernel.name
        assert re.search(r"accv\d+\[\(\d+ \+ z\d+\)\] = ra\d+;", image), kernel.name
        assert "volatile" not in buffer and re.search(r"accv\d+\[\d+\](\.\w+)? \+=", buffer), kernel.name
    nodes, inits = TEXEL_CASES["conv_1x1_w8"][:2]
    few = _staged(lowered_kernels(write_case(str(tmp_path / "few.onnx"), nodes, inits), options=OPTIONS))
    assert few and not any("volatile" in render_kernel(k.ir, IMAGE) for k in few)
    gpu_profile = profile_with(str(tmp_path), "local", cpu=False, private_floats=64)
    gpu = _staged(lowered_kernels(path, target=gpu_profile, options=OPTIONS))
    assert gpu and not any("volatile" in render_kernel(k.ir, IMAGE) for k in gpu)
