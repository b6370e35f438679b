"""How a work-group reduces (KernelBuilder.merge_across_group, merge_tiles_across_group): a 4-way __local tree,
a sub-group path where the profile says the device has sub-groups, one writer, the group size stated in the
source as the plan launches it. Numbers of these kernels: test_kernels_more.py (long rows, shared on adreno830),
test_kernels_other.py (softmax rows), test_oclgrind.py ("group reductions": races and __local bounds)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from onnx import helper

from fblc.codegen import ir as kir
from fblc.codegen.compile import compile_model
from tests.support.kernel_ir import lowered_kernels, statements
from tests.test_kernels_contraction import OPTIONS, TILE_CASES, write_case

#: a LayerNorm over rows of 2048 and a LogSumExp of its output: statistics and LSE each a group per texel
NODES = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1, epsilon=1e-5),
         helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", 7, [1], [1])),
         helper.make_node("ReduceLogSumExp", ["n", "axes"], ["y"], keepdims=1)]
INITS = {"x": (4, 2048), "scale": (2048,), "bias": (2048,)}


@pytest.fixture(scope="module")
def rows_model(tmp_path_factory) -> str:
    return write_case(str(tmp_path_factory.mktemp("rows") / "rows.onnx"), NODES, INITS)


def _tree_barriers(group: int) -> int:
    """A tree merge's barriers: the partials stored, each level, the slots free again."""
    levels = 0
    while group > 4:  # each level joins 4 partials a work-item, down to 4 that every work-item joins
        group //= 4
        levels += 1
    return levels + 2


def _stores_outside_work_item_0(body: list[kir.Statement], guarded: bool = False) -> int:
    """Texel writes that a work-item other than 0 may reach."""
    count = 0
    for s in body:
        if isinstance(s, kir.Store):
            count += not guarded
        inner = guarded or (isinstance(s, kir.If) and s.condition == kir.Var("lid", 0, kir.INT, "lid").eq(0))
        count += sum(_stores_outside_work_item_0(b, inner) for b in kir.nested(s))
    return count


@pytest.mark.parametrize("target,sub_groups", [("adreno830", True), ("local", False)])
def test_group_merges_take_a_4_way_tree_and_sub_groups_where_the_profile_has_them(rows_model: str, target: str,
                                                                                  sub_groups: bool) -> None:
    """Every merge of the statistics and LogSumExp kernels: a tree of log4(group) levels (6 barriers of a
    128-item group's binary tree become 3), with the sub-group built-ins beside it (2 barriers) where the
    profile's `subgroups` figure says so (adreno830), and the tree alone where it does not (PoCL's local).
    Each merge joins the 4 rows of an output texel at once; only work-item 0 writes; LogSumExp reads each row
    once (one loop over it, not a max pass and a sum pass)."""
    kernels = {k.name: k for k in lowered_kernels(rows_model, target, options=OPTIONS) if k.group_size}
    names = {name.split("_", 1)[1] for name in kernels}
    assert {"LayerNormalization_stats", "ReduceLogSumExp"} <= names, names
    for kernel in kernels.values():
        # two merges (sum, centred squares; max, rescaled sums) or one (the gradient's sibling ReduceMeans share a
        # kernel, one loop and one merge of their partials: reduce.fuse_sums, g * x_hat computed as it is read:
        # fuse's prologue), each joining the texel's 4 rows at once
        merges = 2 if kernel.name.endswith(("_stats", "LogSumExp")) else 1
        features = [s for s in statements(kernel) if isinstance(s, kir.WithFeature)]
        if not sub_groups:
            assert not features, kernel.name
            barriers = sum(isinstance(s, kir.Barrier) for s in statements(kernel))
            assert barriers == merges * _tree_barriers(kernel.group_size), (kernel.name, barriers)
            continue
        assert len(features) == merges, kernel.name
        assert features, kernel.name
        for feature in features:
            tree = sum(isinstance(s, kir.Barrier) for s in kir.walk(feature.orelse))
            assert tree == _tree_barriers(kernel.group_size), (kernel.name, tree)
            assert sum(isinstance(s, kir.Barrier) for s in kir.walk(feature.then)) == 2, kernel.name
            built_ins = {e.function for s in kir.walk(feature.then) for x in kir.statement_exprs(s)
                         for e in kir.walk_expr(x) if isinstance(e, kir.Call)}
            assert built_ins & {"sub_group_reduce_add", "sub_group_reduce_max"}, (kernel.name, built_ins)
        assert _stores_outside_work_item_0(kernel.ir.body) == 0, kernel.name
    lse = next(k for k in kernels.values() if k.name.endswith("ReduceLogSumExp"))
    dealt = [s for s in statements(lse) if isinstance(s, kir.For) and s.step == lse.group_size]
    assert len(dealt) == 4, len(dealt)  # one loop dealing out each of the texel's rows, not a max and a sum pass


def test_the_group_size_is_in_the_source_as_the_plan_launches_it_and_the_sub_group_path_type_checks(
        rows_model: str, tmp_path) -> None:
    """reqd_work_group_size on exactly the kernels written for one group size, equal to plan.json's local size
    (what LocalRunner and the native runner launch). Neither PoCL nor oclgrind has sub-groups, so the
    sub-group path runs nowhere here: clang-15 type-checks it as a device with cl_khr_subgroups compiles it
    (OpenCL C 2.0; preprocessed, the built-ins are there), and without the extension it is gone."""
    bundle = tmp_path / "rows.bundle"
    compile_model(rows_model, str(bundle), "adreno830", "fp32", OPTIONS)
    source = (bundle / "kernels.cl").read_text()
    lines = source.splitlines()
    plan = json.loads((bundle / "plan.json").read_text())
    for launch in plan["kernels"]:
        # the __kernel's line (after any functions of co-launched parts it is the first to call: codegen/co_launch.py)
        head = next(line for line in lines[launch["lines"][0]:launch["lines"][1]] if "__kernel void" in line)
        stated = re.search(r"reqd_work_group_size\((\d+), 1, 1\)", head)
        grouped = launch["schedule"]["group_size"] > 1 if "schedule" in launch else False
        assert (int(stated.group(1)) if stated else None) == (launch["local_size"][0] if grouped else None), head
    assert any(launch.get("schedule", {}).get("group_size", 1) > 1 for launch in plan["kernels"])
    clang = shutil.which("clang-15")
    if clang is None:
        pytest.skip("clang-15 is missing: the sub-group source is not type-checked")
    for name in ("kernels.cl", "kernels.buffer.cl"):
        path = str(bundle / name)
        with_sub_groups = [clang, "-x", "cl", "-cl-std=CL2.0", "-Xclang", "-cl-ext=+cl_khr_subgroups"]
        checked = subprocess.run([*with_sub_groups, "-fsyntax-only", path], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr[-3000:]
        expanded = subprocess.run([*with_sub_groups, "-E", path], capture_output=True, text=True, check=True).stdout
        assert "sub_group_reduce_add(" in expanded and "sub_group_reduce_max(" in expanded, name
        plain = subprocess.run([clang, "-x", "cl", "-cl-std=CL1.2", "-E", path], capture_output=True, text=True,
                               check=True).stdout
        assert "sub_group_reduce" not in plain and "barrier(" in plain, name


def test_a_shared_tile_merges_in_odd_pitch_rows_and_work_item_0_writes() -> None:
    """A MatMul over K = 1100 shared by a work-group: partials stored in rows of an odd pitch (consecutive
    work-items' words in distinct banks, both when storing rows and when summing columns), the tile's texels
    computed and written by work-item 0 alone, its tile loop unrolled (accumulators indexed by constants)."""
    import tempfile

    nodes, inits, _ = TILE_CASES["matmul_long_k_shared"]
    with tempfile.TemporaryDirectory() as directory:
        kernels = [k for k in lowered_kernels(write_case(f"{directory}/m.onnx", nodes, inits), "adreno830",
                                              options=OPTIONS) if k.group_size and k.family == "matmul"]
    assert kernels
    for kernel in kernels:
        local = next(s for s in statements(kernel) if isinstance(s, kir.DeclareArray) and s.local)
        lanes = max(s.length for s in statements(kernel) if isinstance(s, kir.DeclareArray) and not s.local
                    and s.var.dtype == kir.FLOAT and isinstance(s.length, int))
        assert local.length == kernel.group_size * (lanes | 1), (local.length, lanes)
        assert _stores_outside_work_item_0(kernel.ir.body) == 0, kernel.name
        assert all(s.unroll for s in statements(kernel) if isinstance(s, kir.For) and s.var.name == "tt")


@pytest.mark.parametrize("version,extensions,standard", [
    ("OpenCL 3.0 PoCL HSTR: pthread-x86_64", "cl_khr_fp64 cl_khr_global_int32_base_atomics", "-cl-std=CL1.2"),
    ("OpenCL 3.0 Adreno(TM) 830", "cl_khr_fp16 cl_khr_subgroups cl_qcom_reqd_sub_group_size", "-cl-std=CL3.0"),
    ("OpenCL 2.0 v1.r26p0", "cl_khr_subgroups cl_arm_printf", "-cl-std=CL2.0"),
    ("OpenCL 1.2 (Oclgrind 21.10)", "cl_khr_subgroups", "-cl-std=CL1.2")])
def test_kernels_build_as_opencl_c_2_or_3_only_on_a_device_with_sub_groups(version: str, extensions: str,
                                                                         standard: str) -> None:
    """LocalRunner builds with OpenCL C 1.2, which every target compiles, except on an OpenCL 2.x / 3.x device
    that lists cl_khr_subgroups: its compiler then declares the sub-group built-ins FBLC_SUBGROUPS calls."""
    from types import SimpleNamespace

    from fblc.runtime.local import language_standard

    assert language_standard(SimpleNamespace(version=version, extensions=extensions)) == standard
