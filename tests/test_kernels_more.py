"""Kernels of issue 12's ops, one training step on PoCL against onnxruntime: HardSwish and
HardSigmoid (elementwise), ReduceL2, InstanceNormalization, AveragePool with ceil_mode.

Each model is the op on trainable initializers, then ReduceSum(y * R) (tests/test_kernels_other.py's
harness), so the forward kernel and the kernels of its backward all run. Shapes pick the code
paths: an innermost axis a multiple of 4 or not (whole-texel reads or per-lane ones), reduced
axes innermost or not, a ceil_mode window past the padded input or none. The cases of MERGED run 12 to a
step (tests/support/merged_steps.py: one PoCL build for 12 cases, each case judged on its own rows).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fblc.codegen import ir as kir
from fblc.passes.pipeline import TrainingOptions
from fblc.tools.verify import verify_model
from support.kernel_ir import keep_lowered, of_type
from tests.support import merged_steps
from tests.test_kernels_other import SGD, _op_then_loss, _randn


HARD_SHAPES = [[2, 3, 8], [3, 5]]
HARD_OPS = [("HardSwish", {}), ("HardSigmoid", {}), ("HardSigmoid", {"alpha": 1.0 / 6.0, "beta": 0.5})]
REDUCE_L2 = [
    ([3, 8], [1], 1),  # innermost, whole texels
    ([2, 3, 5], [-1], 0),  # innermost, per lane
    ([4, 3, 4], [0, 2], 0),  # outer and inner axes
    ([2, 6, 4], None, 1),  # everything
]
INSTANCE_NORMS = [[2, 3, 4, 4], [2, 3, 3, 3], [2, 4, 10]]
CEIL_POOLS = [
    (7, 4, 4, [0, 0, 0, 0], 1),  # AvgPool2d(4, ceil_mode=True) on 7x7: a partial last window per axis
    (6, 3, 2, [1, 1, 1, 1], 1),  # past the end pad: divided by the taps inside the pads
    (6, 3, 2, [1, 1, 1, 1], 0),
    (6, 3, 2, [0, 1, 1, 0], 1),  # asymmetric pads
    (5, 2, 3, [1, 1, 1, 1], 1),  # a last window in the end padding: dropped, ceil_mode=0 at import
]
REMAPPED = [("HardSwish", {}, [2, 8, 4]), ("ReduceL2", {"keepdims": 0}, [2, 8])]
SLICES = [([0, 1], [4, 8], [0, 1], [2, 3]), ([5], [-9], [1], [-2])]


def _hard_case(op_type: str, attributes: dict[str, float], shape: list[int], seed: int) -> onnx.ModelProto:
    op = helper.make_node(op_type, ["x"], ["y"], name="act", **attributes)
    return _op_then_loss(op, shape, {"x": _randn(*shape, seed=seed, scale=2.5)}, seed=seed + 1)


def _hard_swish_after_conv_case(seed: int) -> onnx.ModelProto:
    extra = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv")]
    op = helper.make_node("HardSwish", ["c"], ["y"], name="act")
    return _op_then_loss(op, [1, 4, 5, 5], {"x": _randn(1, 3, 5, 5, seed=seed), "w": _randn(4, 3, 3, 3, seed=seed + 2)},
                         extra=extra, seed=seed + 1)


def _reduce_l2_case(shape: list[int], axes: list[int] | None, keepdims: int, seed: int) -> onnx.ModelProto:
    x = _randn(*shape, seed=seed)
    x.reshape(shape[0], -1)[0] = 0.0  # a zero norm where the first row is reduced alone: its gradient is 0
    inputs = ["x", "axes"] if axes is not None else ["x"]
    extra = ([helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array(axes, np.int64)),
                               name="axes")] if axes is not None else [])
    rank = len(shape)
    reduced = {a % rank for a in axes} if axes is not None else set(range(rank))
    y_shape = [1 if i in reduced else d for i, d in enumerate(shape) if keepdims or i not in reduced]
    op = helper.make_node("ReduceL2", inputs, ["y"], keepdims=keepdims, name="norm")
    return _op_then_loss(op, y_shape, {"x": x}, extra=extra, seed=seed + 1)


def _instance_norm_case(shape: list[int], seed: int) -> onnx.ModelProto:
    channels = shape[1]
    op = helper.make_node("InstanceNormalization", ["x", "scale", "bias"], ["y"], epsilon=1e-5, name="inorm")
    inits = {"x": _randn(*shape, seed=seed, scale=2.0) + 1.0, "scale": _randn(channels, seed=seed + 2) + 1.0,
             "bias": _randn(channels, seed=seed + 3)}
    return _op_then_loss(op, shape, inits, seed=seed + 1)


def _ceil_pool_case(size: int, kernel: int, stride: int, pads: list[int], include: int, seed: int) -> onnx.ModelProto:
    from fblc.compiler.shape_rules import pool_output_size

    op = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[kernel, kernel], strides=[stride, stride],
                          pads=pads, ceil_mode=1, count_include_pad=include, name="pool")
    out = [pool_output_size(size, kernel, stride, 1, pads[a], pads[a + 2], True) for a in range(2)]
    return _op_then_loss(op, [2, 3, *out], {"x": _randn(2, 3, size, size, seed=seed)}, seed=seed + 1)


def _remapped_transpose_case(op_type: str, attributes: dict[str, int], y_shape: list[int], seed: int) -> onnx.ModelProto:
    extra = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1], name="t")]
    inputs = ["xt"]
    if op_type == "ReduceL2":
        extra.append(helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([-1], np.int64)),
                                      name="axes"))
        inputs.append("axes")
    op = helper.make_node(op_type, inputs, ["y"], name="op", **attributes)
    return _op_then_loss(op, y_shape, {"x": _randn(2, 4, 8, seed=seed, scale=2.5)}, extra=extra, seed=seed + 1)


def _strided_slice_case(starts: list[int], ends: list[int], axes: list[int], steps: list[int],
                        seed: int) -> onnx.ModelProto:
    ints = {"starts": starts, "ends": ends, "axes": axes, "steps": steps}
    extra = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(np.array(v, np.int64)), name=k)
             for k, v in ints.items()]
    y_shape = list(np.empty((4, 8))[tuple(slice(None) if a not in axes else
                                          slice(starts[axes.index(a)], ends[axes.index(a)], steps[axes.index(a)])
                                          for a in range(2))].shape)
    op = helper.make_node("Slice", ["x", *ints], ["y"], name="strided")
    return _op_then_loss(op, y_shape, {"x": _randn(4, 8, seed=seed)}, extra=extra, seed=seed + 1)


#: every case of the tests below, each drawing its values with seeds of its own (10 apart)
MERGED = merged_steps.MergedCases(TrainingOptions(loss="output", optimizer=SGD))
for _prefix, _build, _params in [
        ("hard", _hard_case, [(*o, s) for s in HARD_SHAPES for o in HARD_OPS]),
        ("hardconv", _hard_swish_after_conv_case, [()]), ("l2", _reduce_l2_case, REDUCE_L2),
        ("inorm", _instance_norm_case, [(s,) for s in INSTANCE_NORMS]), ("ceilpool", _ceil_pool_case, CEIL_POOLS),
        ("remapped", _remapped_transpose_case, REMAPPED), ("slice", _strided_slice_case, SLICES)]:
    for _index, _args in enumerate(_params):
        MERGED.add(_prefix if _args == () else f"{_prefix}{_index}", _build(*_args, seed=10 * len(MERGED.models)))
MERGED_GROUP = pytest.mark.xdist_group("more-merged")  # one worker builds the merged steps for all their tests


@MERGED_GROUP
@pytest.mark.parametrize("shape", HARD_SHAPES)
@pytest.mark.parametrize("op_type,attributes", HARD_OPS)
def test_hard_activations(merged_folder, op_type: str, attributes: dict[str, float], shape: list[int]) -> None:
    """Spread over (-5, 5), so every piece of the activation (and of its slope) is hit."""
    MERGED.check(f"hard{HARD_SHAPES.index(shape) * len(HARD_OPS) + HARD_OPS.index((op_type, attributes))}",
                 merged_folder)


@MERGED_GROUP
def test_hard_swish_fused_after_conv(merged_folder) -> None:
    """HardSwish as a conv epilogue (MobileNetV3's conv-BN-HardSwish), through evaluate_chain."""
    MERGED.check("hardconv", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("shape,axes,keepdims", REDUCE_L2)
def test_reduce_l2(merged_folder, shape: list[int], axes: list[int] | None, keepdims: int) -> None:
    MERGED.check(f"l2{REDUCE_L2.index((shape, axes, keepdims))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("shape", INSTANCE_NORMS)
def test_instance_norm(merged_folder, shape: list[int]) -> None:
    """Planes of 16 (whole texels: the statistics in the prologue), 9 and 10 (per lane)."""
    MERGED.check(f"inorm{INSTANCE_NORMS.index(shape)}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("size,kernel,stride,pads,include", CEIL_POOLS)
def test_average_pool_ceil_mode(merged_folder, size: int, kernel: int, stride: int, pads: list[int],
                                include: int) -> None:
    MERGED.check(f"ceilpool{CEIL_POOLS.index((size, kernel, stride, pads, include))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("op_type,attributes,y_shape", REMAPPED)
def test_reads_a_remapped_transpose(merged_folder, op_type: str, attributes: dict[str, int], y_shape: list[int]) -> None:
    """Under --layout rtile the Transpose in front becomes an index map (both ops are strided readers):
    the kernel reads x through it."""
    MERGED.check(f"remapped{REMAPPED.index((op_type, attributes, y_shape))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("starts,ends,axes,steps", SLICES)
def test_strided_slice(merged_folder, starts: list[int], ends: list[int], axes: list[int], steps: list[int]) -> None:
    """A strided (or reversed) slice: its gradient gathers each input element's dy (or a zero)."""
    MERGED.check(f"slice{SLICES.index((starts, ends, axes, steps))}", merged_folder)


def _group_kernels_checked(tmp_path, monkeypatch, model: onnx.ModelProto) -> dict[str, bool]:
    """Whether each kernel of `model`'s adreno830 bundle shares its work across a work-group (a launch of
    whole groups whose IR merges through __local memory: barriers), once its step, run on the local device
    in buffer storage, equals onnxruntime's (test_kernels_other.py's _check does so for `local`)."""
    path, bundle = str(tmp_path / "model.onnx"), tmp_path / "adreno830"
    onnx.save(model, path)
    kept = keep_lowered(monkeypatch)
    rows = verify_model(path, TrainingOptions(loss="output", optimizer=SGD), target="adreno830", storage="buffer",
                        keep_bundle=str(bundle))
    assert rows and not [r for r in rows if not r.ok], [r for r in rows if not r.ok]
    plan = json.loads((bundle / "plan.json").read_text())
    kernels = kept[-1]  # the adreno830 bundle's (compiled last)
    return {k["name"]: k["global_size"][0] % k["local_size"][0] == 0 and bool(of_type(kernels[k["name"]], kir.Barrier))
            for k in plan["kernels"]}


@pytest.mark.parametrize("op_type,shape,axes,keepdims", [
    ("ReduceSum", [4, 2000], [1], 1),  # innermost, whole texels: strided texel shares
    ("ReduceSum", [3000, 8], [0], 0),  # an outer axis (a bias gradient over batch x sequence)
    ("ReduceMax", [2, 4, 1500], [0, 2], 0),  # outer and inner axes, merged by fmax
    ("ReduceMean", [6, 1202], [1], 1),  # innermost, per lane (1202 is not a multiple of 4)
    ("ReduceL2", [2, 3, 40, 40], [2, 3], 1),
    # a BatchNorm gradient's maps of 25 x 15 under the batch: rows of 375 dealt out, row offsets computed per row
    ("ReduceSum", [4, 3, 25, 15], [0, 2, 3], 1),
    ("ReduceSum", [600, 3, 5], [0, 2], 1),  # runs of 5, shorter than the group: the 600 runs are dealt out
])
def test_long_reductions_are_shared_by_a_work_group(tmp_path, monkeypatch, op_type: str, shape: list[int], axes: list[int],
                                                    keepdims: int) -> None:
    """Reductions longer than the serial limit: one work-group per output texel, a tree in __local
    memory. The adreno830 kernel must use it (barriers, a launch of whole groups) and its step, run on
    the local device, equal onnxruntime."""
    extra = [helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array(axes, np.int64)),
                              name="axes")]
    reduced = {a % len(shape) for a in axes}
    y_shape = [1 if i in reduced else d for i, d in enumerate(shape) if keepdims or i not in reduced]
    op = helper.make_node(op_type, ["x", "axes"], ["y"], keepdims=keepdims, name="long")
    shared = _group_kernels_checked(tmp_path, monkeypatch, _op_then_loss(op, y_shape, {"x": _randn(*shape)}, extra=extra))
    assert any(is_shared for name, is_shared in shared.items() if name.endswith(op_type)), shared


@pytest.mark.parametrize("shape,axis", [([3, 2048], -1), ([2, 5, 600], 1), ([4, 1030], 1)])
def test_layer_norm_statistics_of_long_rows_are_shared_by_a_work_group(tmp_path, monkeypatch, shape: list[int],
                                                                        axis: int) -> None:
    """Rows longer than the serial limit: the Mean / InvStdDev kernel runs a work-group per texel of
    rows (two __local merges: the sum, then the centred squares). The bias is offset so that the
    loss, a sum of y * R over thousands of elements, does not cancel to rounding noise."""
    norm_shape = shape[axis % len(shape):]
    op = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y", "mean", "inv"], axis=axis,
                          epsilon=1e-5, name="ln")
    model = _op_then_loss(op, shape, {"x": _randn(*shape, scale=3.0), "scale": _randn(*norm_shape, seed=2),
                                      "bias": _randn(*norm_shape, seed=3) + 5.0})
    shared = _group_kernels_checked(tmp_path, monkeypatch, model)
    stats = [is_shared for name, is_shared in shared.items() if name.endswith("_stats")]
    assert stats and all(stats), shared


def test_a_long_reductions_epilogue_that_saves_a_mask_runs_without_a_work_group(tmp_path, monkeypatch) -> None:
    """m = ReduceMean over 1028 (a work-group's length), c = m > lo in its epilogue, y = Where(c, x, hi): the
    backward reads c, so the reduction kernel writes it as a saved mask, whose bytes pair texels of two
    items; a group kernel cannot (builder.finish), so this one takes no work-group, and its step (the
    epilogue, the mask, the updates fused into the gradient sums) equals onnxruntime's."""
    extra = [helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([1], np.int64)),
                              name="axes"),
             helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1, name="mean"),
             helper.make_node("Greater", ["m", "lo"], ["c"], name="above")]
    op = helper.make_node("Where", ["c", "x", "hi"], ["y"], name="pick")
    inits = {"x": _randn(2, 1028), "lo": np.array(-0.01, np.float32), "hi": np.array(0.01, np.float32)}
    shared = _group_kernels_checked(tmp_path, monkeypatch, _op_then_loss(op, [2, 1028], inits, extra=extra))
    assert [is_shared for name, is_shared in shared.items() if name.endswith("_ReduceMean")] == [False], shared


def test_a_run_of_no_multiple_of_4_is_read_as_whole_texels(tmp_path) -> None:
    """BatchNorm's gradient sums [4, 3, 25, 15] over all but the channels: 12 runs of 375 elements, each
    starting anywhere in a texel. Its kernel reads each texel of a run once, its lanes in turn (those of a
    run's end texels outside it skipped), 95 a run (375 elements at the worst alignment): 1,140 reads and the
    fused loss's read of R, not 4,500 element reads."""
    from fblc.tools.kernel_stats import kernel_figures
    from support.kernel_ir import lowered_kernels

    axes = helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0, 2, 3], np.int64)))
    op = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1, name="bn_sum")
    path = str(tmp_path / "runs.onnx")
    onnx.save(_op_then_loss(op, [1, 3, 1, 1], {"x": _randn(4, 3, 25, 15)}, extra=[axes]), path)
    for target in ("adreno830", "local"):
        kernel = next(k for k in lowered_kernels(path, target, options=TrainingOptions(loss="output", optimizer=SGD))
                      if "bn_sum" in k.nodes)
        assert kernel_figures(kernel.ir, kernel.global_size, kernel.group_size).fetch_runs == 12 * 95 + 1, target
