"""Launch schedules: every kernel launch of plan.json has a work-group size from the target profile
and a global size padded to whole groups; both runtimes launch with them and refuse, naming the
launch, a work-group the device cannot run.

Golden: the schedule of each shipped target (whole waves, within max_work_group_size, padding
under one group). Numeric: the bundles of the device tests run with these schedules (every
launch of a real model padded, and the padded work-items must write nothing: the results
still equal onnxruntime's). Negative: a plan whose work-groups exceed the device's limit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fblc import bundle_format as fmt
from fblc.bundle_format import BundleError
from fblc.codegen import ir as kir
from fblc.codegen.cl import Kernel
from fblc.codegen.compile import compile_model
from fblc.codegen.plan import lower, step_schedules
from fblc.codegen.schedule import load_overrides
from fblc.compiler.model_io import load_model
from fblc.errors import FblcError
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.profiles import load_profile, shipped_targets
from fblc.profiles.profile import GROUP_ITEMS
from fblc.runtime.local import LocalRunner
from fblc.tools.verify import verify_model
from support.bundles import edit_plan
from support.kernel_ir import keep_lowered, of_type, profile_with
from tests.conftest import mlp_proto
from tests.test_runtime import OPTIONS, elementwise_model


@pytest.mark.parametrize("target", shipped_targets())
def test_launch_size_is_whole_waves_within_the_device_limit(target: str) -> None:
    profile = load_profile(target)
    for items in (1, 3, profile.wave_size, GROUP_ITEMS - 1, GROUP_ITEMS, 1000, 4097, 123457):
        global_size, group = profile.launch_size(items)
        assert group <= profile.max_work_group_size and global_size % group == 0
        assert items <= global_size < items + group, (items, global_size, group)
        assert group % profile.wave_size == 0 or group == profile.max_work_group_size
        if items >= GROUP_ITEMS:
            assert group == min(GROUP_ITEMS, profile.max_work_group_size) or group % profile.wave_size == 0


def test_a_small_device_limit_caps_the_group() -> None:
    profile = load_profile("adreno830")
    small = type(profile)(**{**profile.__dict__, "max_work_group_size": 32, "wave_size": 16})
    assert small.launch_size(1000) == (1024, 32)
    assert small.launch_size(5) == (16, 16)


def test_a_long_tile_reduction_is_shared_by_a_group_within_its_loop_and_local_memory() -> None:
    """Profile.tile_group: a register tile whose reduction passes SERIAL_REDUCTION per accumulator takes
    a power-of-two group, within GROUP_ITEMS, the device's limit, SHARED_TILE_FLOATS of partials and the
    loop it deals out: one work-item per iteration, or where those leave a GPU idle, the least power of two
    that gives each work-item one iteration at most (Profile.loop_group); a short reduction or a single
    trip, none."""
    from fblc.profiles.profile import SERIAL_REDUCTION, SHARED_TILE_FLOATS

    profile, local = load_profile("adreno830"), load_profile("local")
    assert profile.tile_group(SERIAL_REDUCTION, 56, 36, profile.device_items) is None  # its tiles fill the device
    assert profile.tile_group(3136, 56, 36, 8) == 64  # a stem's 3x3 weight gradient: 56 dY rows, 8 x 32 idle
    assert profile.tile_group(3136, 56, 36, 100) == 32  # 100 x 32 fill it: no idle work-items
    assert local.tile_group(3136, 56, 36, 8) == 32  # a CPU: one work-item per iteration
    assert profile.tile_group(3136, 1, 36, 8) is None
    assert profile.loop_group(0, 8) == 0 and profile.loop_group(3, 8) == 4 and profile.loop_group(3, 10 ** 4) == 2
    assert profile.tile_group(2000, 500, 64, 8) == min(GROUP_ITEMS, SHARED_TILE_FLOATS // 64)
    assert profile.tile_group(3136, 56, 36, 100_000) == 32  # a GPU shares however many tiles there are
    small = type(profile)(**{**profile.__dict__, "max_work_group_size": 16})
    assert small.tile_group(3136, 56, 36, 8) == 16


def test_a_short_reduction_is_shared_only_where_its_items_leave_the_device_idle() -> None:
    """On a GPU a reduction within SERIAL_REDUCTION takes the least power-of-two group whose work-items fill
    the device (compute_units x waves_per_unit x wave_size), each keeping SPLIT_STEPS steps or more; none
    where its items fill the device alone, or on a CPU (whose speed rules are CPU_BUSY_TILES'). The 730
    and the 830 differ in size, so their groups do."""
    from fblc.profiles.profile import SPLIT_STEPS

    a830, a730, local = load_profile("adreno830"), load_profile("adreno730"), load_profile("local")
    assert (a830.device_items, a730.device_items) == (6 * 4 * 64, 4 * 4 * 64)
    assert a830.tile_group(512, 64, 64, 320) == 8  # 320 tiles: 4 make 1280 work-items, under 1536
    assert a730.tile_group(512, 64, 64, 320) == 4  # 1280 fill the 730's 1024
    assert a830.tile_group(512, 64, 64, a830.device_items) is None
    assert a830.tile_group(512, 2, 64, 320) == 2  # at most one work-item per iteration of the dealt loop
    assert a830.tile_group(4 * SPLIT_STEPS, 64, 16, 1) == 4  # each work-item still takes SPLIT_STEPS
    assert a830.tile_group(2 * SPLIT_STEPS - 1, 64, 16, 1) is None  # too short to split
    assert local.tile_group(512, 64, 64, 1) is None
    # a reduction's work-items per output texel likewise; a long one's as before, however many outputs
    assert a830.reduction_group(2048, 10 ** 6) == 128 and a830.reduction_group(10 ** 5, 1) == 256
    assert a830.reduction_group(1000, 4) == 32 and a830.reduction_group(1000, 600) == 4  # 1000 // 16: 62
    assert a830.reduction_group(1000, a830.device_items) is None and local.reduction_group(1000, 4) is None
    assert load_profile("mali-g925").reduction_group(1000, 24) == 32  # 24 x 32 = 768, its size
    assert a830.reduction_group(40, 1) == 2 and a830.reduction_group(2 * SPLIT_STEPS - 1, 1) is None


def test_a_cpu_shares_a_tile_reduction_only_where_its_tiles_are_too_few_to_keep_it_busy() -> None:
    """On a CPU a work-group's items run in turn on one core: CPU_BUSY_TILES tiles per compute unit
    run their reductions alone (no merge through __local memory); fewer tiles share them as a GPU does."""
    from fblc.profiles.profile import CPU_BUSY_TILES

    local = load_profile("local")
    assert local.cpu and not load_profile("adreno830").cpu
    assert local.tile_group(3136, 56, 36, CPU_BUSY_TILES * local.compute_units) is None
    assert local.tile_group(3136, 56, 36, CPU_BUSY_TILES * local.compute_units - 1) == 32


def test_tiles_per_group_fill_a_wave_with_whole_tiles() -> None:
    """Profile.tiles_per_group: a tile group under a wave takes as many tiles as fill it, a power of two
    that divides the tile count, within max_work_group_size and SHARED_TILE_FLOATS; none past a wave."""
    from fblc.profiles.profile import SHARED_TILE_FLOATS

    adreno = load_profile("adreno830")  # 64-wide waves
    assert adreno.tiles_per_group(32, 36, 8) == 2  # the stem's weight gradient: 32 work-items a tile
    assert adreno.tiles_per_group(16, 36, 6) == 2  # 4 would fill the wave, but only 2 divides 6 tiles
    assert adreno.tiles_per_group(32, 36, 7) == 1  # an odd count: every group holds one
    assert adreno.tiles_per_group(64, 16, 8) == 1  # a whole wave already
    assert adreno.tiles_per_group(16, SHARED_TILE_FLOATS // 32, 8) == 2  # the partials of 2 tiles fit, not 4
    assert load_profile("mali-g925").tiles_per_group(32, 36, 8) == 1  # 16-wide waves
    small = type(adreno)(**{**adreno.__dict__, "max_work_group_size": 32})
    assert small.tiles_per_group(16, 36, 8) == 2


def _written_group(kernel: Kernel) -> tuple[int, int, int] | None:
    """(items, work-items per item, items per work-group) as a group kernel's IR deals out its work: its
    `if (item >= items) return`, the step of its loops from `lid`, its merge tree's first stride (half the
    group) or its tile merge's `shared[j * group + lid]`, and the items in a work-group (its item
    `get_group_id(0) * tiles + ...`); its __local floats hold whole groups of every item. None for a kernel
    that uses no work-group (a plain one)."""
    calls = {e.function for e in of_type(kernel, kir.Call)}
    if "get_group_id" not in calls:
        assert "get_local_id" not in calls and not of_type(kernel, kir.Barrier), kernel.name
        return None
    items = [s.condition.b.value for s in kernel.ir.body if isinstance(s, kir.If) and s.then == [kir.Return()]
             and isinstance(s.condition, kir.Binary) and s.condition.op == ">=" and isinstance(s.condition.b, kir.Const)]
    tiles = [e.a.b.value for e in of_type(kernel, kir.Binary) if e.op == "+" and isinstance(e.a, kir.Binary)
             and e.a.op == "*" and isinstance(e.a.a, kir.Call) and e.a.a.function == "get_group_id"]
    loops = of_type(kernel, kir.For)
    groups = {loop.step for loop in loops if isinstance(loop.start, kir.Var) and loop.start.name == "lid"}
    groups |= {2 * loop.start.value for loop in loops if loop.step_op == ">>=" and isinstance(loop.start, kir.Const)}
    groups |= {e.index.a.b.value for e in of_type(kernel, kir.Element) if e.array.name == "shared"
               and isinstance(e.index, kir.Binary) and e.index.op == "+" and isinstance(e.index.b, kir.Var)
               and e.index.b.name == "lid" and isinstance(e.index.a, kir.Binary) and e.index.a.op == "*"
               and isinstance(e.index.a.b, kir.Const)}
    assert len(items) == 1 and len(tiles) <= 1 and len(groups) == 1, (kernel.name, items, tiles, groups)
    group, per_group = groups.pop(), tiles[0] if tiles else 1
    local = [s.length for s in of_type(kernel, kir.DeclareArray) if s.local]
    assert len(local) == 1 and local[0] % (group * per_group) == 0, (kernel.name, local, group, per_group)
    return items[0], group, per_group


def _shared_tiles_model(folder: str) -> str:
    from tests.test_kernels_contraction import TILE_CASES, write_case

    nodes, inits, _ = TILE_CASES["conv_temporal_weight_grad_shared"]  # two or four tiles a work-group
    return write_case(os.path.join(folder, "temporal.onnx"), nodes, inits)


def _tresnet64(folder: str) -> str:
    from support import models

    return models._example("tresnet")(os.path.join(folder, "tresnet64.onnx"), batch=64)


#: models with group kernels: T-ResNet B=64 (long reductions, 33 group launches), a shared register tile
SCHEDULED_MODELS = {"t-resnet B=64": (_tresnet64, TrainingOptions()),
                    "shared tiles": (_shared_tiles_model, TrainingOptions(loss="output"))}


@pytest.mark.parametrize("target", ["adreno830", "mali-g925", "local"])
def test_every_launch_of_a_real_bundle_is_scheduled(tmp_path, monkeypatch, target: str) -> None:
    """A plain kernel: the profile's work-group, its global size padded to whole groups. A group kernel
    (work-items share __local memory): the work-group its code is written for (the work-items of each
    item times the items a group holds) and exactly its items' work-items, whole groups, no padding."""
    profile = load_profile(target)
    padded, grouped, tiled = 0, 0, 0
    for name, (build, options) in SCHEDULED_MODELS.items():
        bundle = str(tmp_path / name)
        kept = keep_lowered(monkeypatch)  # the bundle's kernels, with their IR
        compile_model(build(str(tmp_path)), bundle, target, "fp32", options)
        _, plan = fmt.load_verified(bundle)
        kernels = kept[-1]
        for launch in plan["kernels"]:
            schedule = [launch["global_size"][0], launch["local_size"][0]]
            kernel = kernels[launch["name"]]
            if kernel.parts:  # co-launched (codegen/co_launch.py): a group part runs its own items' groups
                for part in kernel.parts:
                    written = _written_group(part)
                    if written is not None:
                        items, group, tiles = written
                        assert [part.global_size, schedule[1]] == [items * group, group * tiles], \
                            (name, launch["name"], part.name, schedule, written)
                        grouped += 1
                        tiled += tiles > 1
                continue
            if any(isinstance(s, kir.Stage) for s in kir.walk(kernel.ir.body)):  # a staged one: plain work-items in
                # the groups its __local copies are written for (codegen/kernels/staging.py), whole groups
                assert profile.local_staging and kernel.ir.group_size == kernel.group_size, (name, launch["name"])
                assert schedule == [launch["items"], kernel.group_size] and launch["items"] % kernel.group_size == 0
                continue
            written = _written_group(kernel)
            if written is None:
                assert schedule == list(profile.launch_size(launch["items"])), (name, launch["name"])
                padded += launch["global_size"][0] != launch["items"]
                continue
            items, group, tiles = written
            assert items % tiles == 0 and group * tiles <= profile.max_work_group_size, (name, launch["name"])
            assert schedule == [items * group, group * tiles] and launch["items"] == items * group, \
                (name, launch["name"], schedule, launch["items"], written)
            grouped += 1
            tiled += tiles > 1
    assert padded > 0, "the test models should exercise padded launches"
    # 10 (was 30; 46/46/36 group kernels before, 21/21/12 after): sibling reductions (BatchNorm's dgamma
    # and dbeta) share one group kernel (passes/fuse.py); a CPU 7: T-ResNet's four weight gradients of 256 and
    # 512 tiles keep it busy unshared (CPU_BUSY_TILES)
    assert grouped >= (7 if profile.cpu else 10) and (tiled > 0 or profile.cpu), (grouped, tiled)


def test_padded_work_items_write_nothing(tmp_path) -> None:
    """A launch of 3 x 5 = 15 texel items padded to whole groups: the step equals onnxruntime's."""
    path = elementwise_model(str(tmp_path / "m.onnx"), rows=15)
    rows = verify_model(path, OPTIONS, target="mali-g925", work_dir=str(tmp_path))
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


def _set_group(bundle: str, group: int) -> None:
    def regroup(plan: dict) -> None:
        for launch in plan["kernels"]:
            launch["local_size"] = [group]
            launch["global_size"] = [-(-launch["global_size"][0] // group) * group]

    edit_plan(bundle, regroup)


def test_a_work_group_beyond_the_device_is_refused_naming_the_launch(tmp_path) -> None:
    bundle = str(tmp_path / "bundle")
    compile_model(elementwise_model(str(tmp_path / "m.onnx")), bundle, "local", "fp32", OPTIONS)
    _set_group(bundle, 1 << 20)
    with pytest.raises(BundleError, match=r"launch 'k0_\w+' has work-groups of 1048576 work-items, beyond"):
        LocalRunner(bundle)


def test_a_bundle_without_schedules_still_runs(tmp_path) -> None:
    """Bundles written before plan.json recorded schedules (local_size null): the driver picks."""
    bundle = str(tmp_path / "bundle")
    compile_model(elementwise_model(str(tmp_path / "m.onnx")), bundle, "local", "fp32", OPTIONS)
    runner = LocalRunner(bundle)
    from tests.test_runtime import batch

    scheduled = runner.step(batch())

    def unschedule(plan: dict) -> None:
        for launch in plan["kernels"]:
            launch["local_size"], launch["global_size"] = None, [launch["items"]]

    edit_plan(bundle, unschedule)
    assert np.isclose(LocalRunner(bundle).step(batch()), scheduled, rtol=1e-6)


# --- schedules as data (codegen/schedule.py, kernels/schedules.py) ---------------------------------------


@pytest.fixture(scope="module")
def mlp_step() -> ir.Model:
    """The conftest MLP's fused step for the local target (a Gemm whose tile is 4 rows x 2 texel columns)."""
    from fblc.compiler.model_io import load_model

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "mlp.onnx")
        onnx.save(mlp_proto(), path)
        return build_training_graph(load_model(path), OPTIONS, lower=load_profile("local"))


def _tiled_gemm(program_schedules: dict, op_type: str = "Gemm") -> str:
    return next(name for name, schedule in program_schedules.items()
                if name.endswith(f"_{op_type}") and schedule["tile_rows"] == 4)


def test_an_edited_schedule_file_changes_the_kernel_and_keeps_its_numbers(tmp_path) -> None:
    """`fblc compile --schedules FILE`: the Gemm's tile of 4 rows becomes 1 and a MatMul's tile is shared by
    4 work-items summing scalar lanes (plan.json records both), the Gemm kernel's source differs, and one
    training step gives the default bundle's loss and parameters."""
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), path)
    bundles = {name: str(tmp_path / name) for name in ("default", "edited")}
    compile_model(path, bundles["default"], "local", "fp32", OPTIONS)
    _, plan = fmt.load_verified(bundles["default"])
    gemm = _tiled_gemm({launch["name"]: launch["schedule"] for launch in plan["kernels"]})
    schedule_file = tmp_path / "schedules.json"
    matmul = _tiled_gemm({launch["name"]: launch["schedule"] for launch in plan["kernels"]}, "MatMul")
    schedule_file.write_text(json.dumps({gemm: {"tile_rows": 1},
                                         matmul: {"group_size": 4, "accumulator_form": "lanes", "pair_stride": 0}}))
    compile_model(path, bundles["edited"], "local", "fp32", OPTIONS, schedules=str(schedule_file))

    def kernel_of(bundle: str) -> tuple[dict, str]:
        _, plan = fmt.load_verified(bundle)
        launch = next(launch for launch in plan["kernels"] if launch["name"] == gemm)
        lines = open(os.path.join(bundle, fmt.KERNELS)).read().splitlines()
        return launch["schedule"], "\n".join(lines[launch["lines"][0]:launch["lines"][1]])

    (default, default_source), (edited, edited_source) = kernel_of(bundles["default"]), kernel_of(bundles["edited"])
    assert (default["tile_rows"], edited["tile_rows"], edited["texels_per_item"]) == (4, 1, 2)
    assert default_source != edited_source
    _, edited_plan = fmt.load_verified(bundles["edited"])
    shared = next(launch for launch in edited_plan["kernels"] if launch["name"] == matmul)
    assert shared["schedule"]["group_size"] == 4 and shared["schedule"]["accumulator_form"] == "lanes"
    assert shared["local_size"][0] % 4 == 0, shared  # a work-group of whole groups of 4 sharing a tile
    feeds = {"x": np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32),
             "labels": np.random.default_rng(3).uniform(0, 1, (4, 3)).astype(np.float32)}
    runners = {name: LocalRunner(bundle, progress=False) for name, bundle in bundles.items()}
    losses = {name: runner.step(feeds) for name, runner in runners.items()}
    assert np.isclose(losses["edited"], losses["default"], rtol=1e-6), losses
    edited_parameters = runners["edited"].parameters()
    for name, array in runners["default"].parameters().items():
        np.testing.assert_allclose(edited_parameters[name], array, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("op_type, fields, message", [
    ("Gemm", {"tile_height": 2}, r"kernel 'k\d+_Gemm': unknown field 'tile_height'.*tile_rows, tile_columns, group_s"),
    ("Gemm", {"tile_rows": 2}, r"kernel 'k\d+_Gemm': tile_rows 2 is not valid for it.*choose one of: 1, 4$"),
    # the forward Gemm writes the Relu's saved mask, whose bytes pair texels of two work-items
    ("Gemm", {"group_size": 2}, r"group_size 2 is not valid for it.*choose one of: 1$"),
    ("MatMul", {"group_size": 3}, r"group_size 3 is not valid for it.*choose one of: 1, 2, 4, 8, 16, 32, 64, 128$"),
    ("MatMul", {"group_size": 256}, r"group_size 256 is not valid for it.*, 128$"),  # 4096 partials / 32 lanes
    ("Gemm", {"accumulator_form": "vectors"}, r"accumulator_form 'vectors' is not valid.*lanes, texels, sums"),
    ("Gemm", {"tile_rows": True}, r"tile_rows True is not valid"),
])
def test_an_invalid_schedule_override_is_refused_naming_kernel_field_value_and_choices(
        mlp_step: ir.Model, op_type: str, fields: dict, message: str) -> None:
    kernel = _tiled_gemm(lower(mlp_step, load_profile("local"), "fp32", with_contents=False).schedules, op_type)
    with pytest.raises(FblcError, match=message) as refused:
        lower(mlp_step, load_profile("local"), "fp32", with_contents=False, overrides={kernel: fields})
    assert kernel in str(refused.value)


def test_a_schedule_override_of_a_missing_kernel_or_an_undecided_field_is_refused(mlp_step: ir.Model) -> None:
    profile = load_profile("local")
    with pytest.raises(FblcError, match=r"kernel 'k999_Gemm', which this step does not have.*k0_\w+, k1_"):
        lower(mlp_step, profile, "fp32", with_contents=False, overrides={"k999_Gemm": {"tile_rows": 2}})
    plain = next(name for name in lower(mlp_step, profile, "fp32", with_contents=False).schedules
                 if name.endswith(("_Mul", "_Sub")))
    with pytest.raises(FblcError, match=rf"kernel '{plain}': its schedule has no choice of 'tile_rows'.*takes: none"):
        lower(mlp_step, profile, "fp32", with_contents=False, overrides={plain: {"tile_rows": 2}})


def test_a_profile_schedules_section_applies_and_a_schedule_file_overrides_it(tmp_path) -> None:
    profile = load_profile("local")
    sectioned = dataclasses.replace(profile, raw={**profile.raw, "schedules": {"k0_Gemm": {"tile_rows": 1,
                                                                                          "group_size": 1}}})
    assert load_overrides(None, sectioned) == {"k0_Gemm": {"tile_rows": 1, "group_size": 1}}
    schedule_file = tmp_path / "s.json"
    schedule_file.write_text(json.dumps({"k0_Gemm": {"tile_rows": 4}, "k3_MatMul": {"pair_stride": 0}}))
    assert load_overrides(str(schedule_file), sectioned) == {"k0_Gemm": {"tile_rows": 4, "group_size": 1},
                                                            "k3_MatMul": {"pair_stride": 0}}
    schedule_file.write_text("[1, 2]")
    with pytest.raises(FblcError, match="schedules must be an object of kernel name"):
        load_overrides(str(schedule_file), profile)


def test_lowering_decides_the_byte_pairing_of_split_masks_without_writing_the_graph(tmp_path) -> None:
    """A Gemm whose 2-D tile has rows of 3 texels (and a conv whose channel tile has rows 4 texels apart) splits
    consecutive texels between work-items: its saved mask's bytes pair the tile's rows instead (r_mask8,
    mask_pair_stride = tile_stride), decided from its schedule before any texture exists; lowering leaves the
    step's metadata as it found it."""
    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.model_io import load_model
    from fblc.compiler.optimizers import OptimizerConfig
    from tests.test_layout_passes import _masked_conv_proto

    path = str(tmp_path / "net.onnx")
    onnx.save(_masked_conv_proto(8, 4, 4, 4, 12), path)
    options = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("sgd", lr=0.1),
                              adapter=AdapterConfig("memflora", rank=2))
    step = build_training_graph(load_model(path), options, lower=load_profile("local"))

    def metadata() -> list[dict]:
        values = list(step.graph.inputs) + [v for n in step.graph for v in n.outputs if v is not None]
        return [dict(v.metadata_props) for v in values] + [dict(n.metadata_props) for n in step.graph]

    before = metadata()
    program = lower(step, load_profile("local"), "fp32", with_contents=False)
    assert metadata() == before
    masks = [t for t in program.textures if t.format.startswith("r_mask")]
    assert [(t.format, t.layout.mask_pair_stride) for t in masks] == [("r_mask8", 4), ("r_mask8", 3)]
    assert [t.width * t.height for t in masks] == [-(-t.numel // 8) for t in masks]  # one bit an element
    paired = {name: s for s in program.schedules.values() for name in s["paired_masks"]}
    assert [paired[t.name]["tile_stride"] for t in masks] == [4, 3]
    assert not any(s["mask4"] for s in program.schedules.values())


def test_a_contraction_too_small_for_the_device_is_split_until_it_fills_it(tmp_path) -> None:
    """A MatMul [64, 256] x [256, 128] under R-Tile: 128 tiles of 8 x 8 outputs, K = 256 (a work-item keeps
    SPLIT_STEPS = 16 of it, so up to 16 work-items a tile). The 830 (1536 work-items at once) deals each tile
    to 16, the 730 (1024) to 8, the CPU to none; the 830's step equals onnxruntime's."""
    from tests.test_kernels_contraction import OPTIONS as STEP, _contractions, _node, write_case

    path = write_case(str(tmp_path / "matmul.onnx"), [_node("MatMul", ["a", "b"])], {"a": (64, 256), "b": (256, 128)})

    forward = {target: min((k for k in _contractions(path, target) if k.name.endswith("_MatMul") and k.global_size >= 128),
                           key=lambda k: int(k.name[1:].split("_")[0]))  # the forward MatMul: fuse numbers it before
               for target in ("adreno830", "adreno730", profile_with(str(tmp_path), "local", local_staging=False))}
    # (its gradients' launches may move: in-place updates; the local CPU's without staging, whose groups are its own)
    assert [kernel.group_size for kernel in forward.values()] == [64, 64, None]  # whole waves of tiles
    assert [kernel.global_size for kernel in forward.values()] == [128 * 16, 128 * 8, 128]
    rows = verify_model(path, STEP, target="adreno830", work_dir=str(tmp_path))
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_a_conv_tile_sees_the_split_its_reduction_really_gets(tmp_path) -> None:
    """A Conv X [8, 2, 128] * W [512, 2, 128] (a pointwise weight gradient's form): channel tiles of 4 output
    channels x B batch elements, 128 taps in 8 blocks of 16, so at most 8 work-items share a tile. No tile fills
    the 830's 1536 work-items alone, so the tile is chosen by texel fetches x rounds knowing that split: 8 batch
    elements (128 tiles x 8 = 1024 work-items, one round) read each weight texel for 8 of them, where 4 (256 x 8
    = 2048, two rounds) would read every weight texel twice as often. The CPU keeps the largest tile (128
    work-items); the 830's step equals onnxruntime's."""
    from tests.test_kernels_contraction import OPTIONS as STEP, _contractions, _node, write_case

    path = write_case(str(tmp_path / "conv.onnx"), [_node("Conv", ["x", "w"])], {"x": (8, 2, 128), "w": (512, 2, 128)})
    forward = {target: next(k for k in _contractions(path, target)
                            if k.name.endswith("_Conv") and not any(n.startswith("grad/") for n in k.nodes))
               for target in ("adreno830", "local")}  # the forward Conv, whatever its number
    assert load_profile("adreno830").device_items == 1536
    assert [kernel.global_size for kernel in forward.values()] == [128 * 8, 128]
    assert forward["adreno830"].group_size == 64  # 8 tiles a group, 8 work-items each
    rows = verify_model(path, STEP, target="adreno830", work_dir=str(tmp_path))
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_a_pointwise_weight_gradient_on_small_maps_takes_two_texels_of_channels(tmp_path) -> None:
    """A 1 x 1 Conv X [4, 128, 2, 2] * W [512, 128, 1, 1]: its weight gradient (a Conv whose 'batch' is W's 512
    output channels, 128 outputs each, reducing over N x H x W = 16: 4 texels) has no spatial extent, so its
    channel tile may take 8 output channels (two texels) where 4 took one (conv_schedules.
    channel_rows_and_batches): 4 channels x 8 batch elements fill the 830 (2,048 tiles), 8 x 8 do not (1,024),
    and the roofline takes 8 x 8, whose x texels each serve 8 channels: per work-item 4 K texels x (8 dY + 8 x
    texels) and W's 16 texels for its SGD update, 81,920 fetches a step where 4 x 8 made 2,048 x (4 x (4 + 8) +
    8) = 114,688. The 830's step equals onnxruntime's."""
    from fblc.tools.kernel_stats import kernel_figures
    from tests.test_kernels_contraction import OPTIONS as STEP, _contractions, _node, write_case

    path = write_case(str(tmp_path / "conv.onnx"), [_node("Conv", ["x", "w"])], {"x": (4, 128, 2, 2), "w": (512, 128, 1, 1)})
    gradient = next(k for k in _contractions(path, "adreno830") if k.name == "k5_Conv")
    assert gradient.global_size == 512 * 128 // 4 // 16
    assert kernel_figures(gradient.ir, gradient.global_size, gradient.group_size).fetch_runs == 1024 * (4 * 16 + 16)
    rows = verify_model(path, STEP, target="adreno830", work_dir=str(tmp_path))
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_a_register_tile_is_chosen_within_the_target_s_registers_and_by_the_device_s_size() -> None:
    """TileBudget: a contraction's tile keeps the target's private_floats accumulators (Mali's 32: 8 x 4
    outputs; Adreno's 64: 8 x 8); the largest tile whose work-items fill the device, else the largest where
    a work-group may split its reduction, else (saved masks) the smallest, for the most work-items. Told the
    reduction's length K (the 830's Profile.tile_group on contraction.tile_reduction), the largest whose tiles
    x group fill the device, else one texel where that fills it or comes closest (a short K splits little)."""
    from fblc.codegen.kernels.contraction import tile_reduction
    from fblc.codegen.kernels.schedules import TileBudget, _contraction_tile

    profile = load_profile("adreno830")

    def tile(private: int, device: int, texels: int, masks: bool = False, k: int = 0) -> tuple[int, int]:
        budget = TileBudget(True, private, device, texels, masks, not masks)
        split = (lambda t, tiles: profile.tile_group(*tile_reduction([(k, 1)], *t), 4 * t[0] * t[1], tiles)) if k else None
        schedule = _contraction_tile(budget, (texels // 32 * 8, 128), texels // 32 * 8, None, split)[0]
        return schedule.tile_rows, schedule.tile_columns

    assert load_profile("mali-g925").private_floats == 32 and load_profile("adreno830").private_floats == 64
    assert tile(64, 0, 2048) == (8, 2) and tile(32, 0, 2048) == (8, 1)  # a CPU: the largest that fits
    assert tile(64, 1536, 32768) == (8, 2)  # 2048 tiles of 16 texels fill 1536 work-items
    assert tile(64, 1536, 16384) == (8, 1)  # 16 texels make 1024 tiles, 8 make 2048
    assert tile(64, 1536, 2048) == (8, 2)  # none fills: a work-group per tile will
    assert tile(64, 1536, 2048, masks=True) == (4, 1)  # none fills and none may split: the most work-items
    assert profile.device_items == 1536
    assert tile(64, 1536, 2048, k=256) == (8, 2)  # 128 tiles of 16 texels x 16 work-items each fill it
    assert tile(64, 1536, 2048, k=64) == (4, 1)  # K = 64 splits 4 ways: 512 tiles of 4 texels x 4 fill it ...
    assert tile(64, 1536, 512, k=64) == (1, 1)  # ... 512 texels: only one texel a tile (x 4 = 2048) fills it
    assert tile(64, 1536, 512, k=32) == (1, 1)  # nothing fills: 512 x 2 comes closest (Llama's K of 32)
    assert tile(64, 0, 512, k=32) == (8, 2)  # a CPU keeps the largest tile


def test_of_the_tiles_that_fill_the_device_the_roofline_takes_the_fastest() -> None:
    """TileBudget.pick told a conv tile's fetches and multiply-adds on a GPU weighs the first tile that fills
    the device and the larger ones before it by the 830's roofline (fblc/profiles/roofline.py): MobileNetV2
    [1,3,32,32]'s 16 -> 96 1x1 conv (6,144 output texels, 16 products an output) fills the 830 with one channel
    of 4 texels a work-item (1,536 items, 68 fetches each) but is bound by the texture units; 4 channels (384
    items of 80 fetches) fetch a quarter of the bytes at a quarter of the lanes, and win. Where the arithmetic
    bounds it (few fetches), the tile that fills the device stays; without the figures, the first that fills."""
    from fblc.codegen.kernels.tile_budget import TileBudget

    profile = load_profile("adreno830")
    budget = TileBudget(True, 64, profile.device_items, 6144, False, True, profile)

    def pick(fetches: dict[int, float], weighed: bool = True) -> int:
        return budget.pick([4, 2, 1], lambda rows: rows * 4, fetches=fetches.get if weighed else None,
                           work=(lambda rows: rows * 4 * 4 * 16) if weighed else None)

    texture_bound = {4: 80.0, 2: 72.0, 1: 68.0}
    assert pick(texture_bound) == 4 and pick(texture_bound, weighed=False) == 1
    assert budget.roofline_ms(384, 1, 80.0, 1024.0) < budget.roofline_ms(1536, 1, 68.0, 256.0)
    assert pick({4: 4.0, 2: 2.0, 1: 1.0}) == 1  # compute-bound: the occupancy of 1,536 work-items wins
    cpu = dataclasses.replace(budget, device_items=0, profile=None)
    assert cpu.pick([4, 2, 1], lambda rows: rows * 4, fetches=texture_bound.get, work=lambda rows: 1.0) == 4


def test_where_no_tile_fills_the_device_the_tile_that_fetches_least_in_its_rounds_wins() -> None:
    """TileBudget.pick told a tile's texel fetches per K step (contraction.tile_fetches): where no tile fills
    the 830 alone, the candidate whose rounds of 1536 work-items times one work-item's fetches are fewest,
    not the one that fills it by reading a texel per output texel (Llama B=2 T=16's MatMuls: 2.5x the
    reads). A reads K along lanes (a forward MatMul) or M along lanes (X^T of a weight gradient)."""
    from fblc.codegen.kernels.contraction import tile_fetches, tile_reduction
    from fblc.codegen.kernels.schedules import TileBudget, _contraction_tile

    profile = load_profile("adreno830")
    forward, transposed = tile_fetches(1, 64, 128, 1), tile_fetches(128, 1, 128, 1)
    assert (forward((1, 1)), forward((4, 1)), forward((8, 2))) == (1.25, 2.0, 4.0)
    assert (transposed((1, 1)), transposed((4, 1)), transposed((8, 2))) == (2.0, 2.0, 4.0)
    assert tile_fetches(1, 64, 1, 64)((4, 2)) == 3.0 and tile_fetches(64, 64, 64, 64)((4, 1)) == 8.0

    def tile(texels: int, k: int, fetches=forward) -> tuple[int, int]:
        budget = TileBudget(True, 64, profile.device_items, texels, False, True)
        split = lambda t, tiles: profile.tile_group(*tile_reduction([(k, 1)], *t), 4 * t[0] * t[1], tiles)  # noqa: E731
        schedule = _contraction_tile(budget, (texels // 32 * 8, 128), texels // 32 * 8, None, split, fetches)[0]
        return schedule.tile_rows, schedule.tile_columns

    # 1024 texels, K = 64: one texel a tile fills the 830 only split (1024 x 2, two rounds of 1.25 x 32 fetches);
    # 4 x 1 tiles split 4 ways (1024 work-items, one round of 2 x 16) fetch least
    assert tile(1024, 64) == (4, 1)
    assert tile(512, 64) == (4, 1)  # 1 x 1: 2048 items, 2 rounds of 1.25 x 16; 4 x 1: 512 items, 1 round of 2 x 16
    assert tile(512, 32) == (1, 1)  # both one round: 1.25 x 16 fetches against 2 x 16
    assert tile(512, 32, transposed) == (4, 1)  # X^T: one lane of each A texel, 2 x 16 either way: the larger tile
    assert tile(2048, 32, transposed) == (4, 1)  # 2048 x 1 texels: two rounds of 2 x 32; 512 x 2: one of 2 x 16
    assert tile(32768, 256) == (8, 2)  # a tile that fills the device alone is unchanged


@pytest.mark.parametrize("target", ["adreno830", "local"])
def test_every_offered_schedule_value_changes_the_kernel_or_is_its_default(tmp_path, target: str) -> None:
    """plan.json's `choices` offer only values the kernel's emitter follows (fblc tune tries each): set
    alone on its kernel, every value other than the one taken changes the kernel's source, and compiles.
    A step with a row-path conv (width 7: reduce_guarded, no group to share it) and its input gradient,
    a channel-tile weight gradient, MatMuls and a reduction; on a CPU the float4 forms offer pairings."""
    from fblc.codegen.render.opencl import IMAGE
    from tests.test_kernels_contraction import OPTIONS as STEP, _node, write_case

    path = write_case(str(tmp_path / "m.onnx"), [_node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]),
                                                 _node("MatMul", ["c", "m"])],
                      {"x": (2, 8, 6, 7), "w": (8, 8, 3, 3), "m": (7, 8)})
    profile = load_profile(target)

    def program(overrides: dict[str, dict[str, object]]) -> object:
        step = build_training_graph(load_model(path), STEP, lower=profile,
                                    schedules=step_schedules(profile, "fp32", overrides))
        return lower(step, profile, "fp32", with_contents=False, overrides=overrides, co_launched_kernels=False)

    default = program({})
    sources = {kernel.name: kernel.render(IMAGE) for kernel in default.kernels}
    offered = {name: [(key, value) for key, values in schedule["choices"].items() for value in values
                      if value != schedule[key]] for name, schedule in default.schedules.items()}
    assert offered["k0_Conv"] and not [v for k, v in offered["k0_Conv"] if k == "group_size"]  # the row path
    unchanged = []
    for index in range(max(map(len, offered.values()))):  # as fblc tune's rounds: one value per kernel
        chosen = {name: dict([values[index]]) for name, values in offered.items() if index < len(values)}
        built = {kernel.name: kernel.render(IMAGE) for kernel in program(chosen).kernels}
        unchanged += [(name, fields) for name, fields in chosen.items() if built[name] == sources[name]]
    assert not unchanged


def test_a_conv_reduction_s_fetches_are_counted_as_texel_fetch_reads_them() -> None:
    """texel.texel_reads, by which Reduction.fetches weighs conv tiles (conv_schedules._tile_group): from a base
    that is a multiple of 4 one read per distinct texel; from any other base each cluster's covering texels
    (a run of 4 from a base of multiples of 2: 2 texels at shift 0 or 2), or one per element where those are no
    fewer (a lone element: 1, not 2)."""
    from fblc.codegen.ir import const
    from fblc.codegen.kernels.texel import texel_reads
    from fblc.codegen.kernels.reduction_terms import Term

    aligned, odd, even = [Term(const(0), 4)], [Term(const(0), 1)], [Term(const(0), 2)]
    assert texel_reads([0, 1, 2, 3, 4, 9], aligned) == 3  # texels 0, 1, 2
    assert texel_reads([0, 1, 2, 3], even) == 2 and texel_reads([0, 1, 2, 3], odd) == 2
    assert texel_reads([0, 1, 2, 3, 4, 5, 6, 7], odd) == 3
    assert texel_reads([0], odd) == 1 and texel_reads([0, 20], odd) == 2  # sparse: element reads
    assert texel_reads([0, 8], [Term(const(0), 1, 4)]) == 2  # a multiple of 4 through the term's multiple
