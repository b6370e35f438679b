"""Normalisation, pooling and gather/scatter kernels: one training step on PoCL against onnxruntime.

Each model is the op under test on trainable initializers followed by ReduceSum(y * R), R a
fixed random constant, so the loss is the model's output and every gradient is non-trivial.
The step runs the forward kernel and the backward's kernels (a ConvTranspose over per-tap shares for MaxPool,
ScatterElements for embeddings and cross-entropy, ConvTranspose for AveragePool).
The cases of MERGED run 11 to a step (tests/support/merged_steps.py: one PoCL build for 11 cases, each case
judged on its own rows: its gradients, its updates and its loss's scale).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.tools.verify import verify_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from tests.conftest import make_model
from tests.support import merged_steps

SGD = OptimizerConfig("sgd", lr=0.1)
#: the softmax, layer norm, pool, gather/scatter and reduction cases (filled by _register at the bottom)
MERGED = merged_steps.MergedCases(TrainingOptions(loss="output", optimizer=SGD), chunk=11)
MERGED_GROUP = pytest.mark.xdist_group("other-merged")  # one worker builds the merged steps for all their tests


def _check(tmp_path, model: onnx.ModelProto, loss: str = "output") -> None:
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    rows = verify_model(path, TrainingOptions(loss=loss, optimizer=SGD))
    assert rows
    bad = [r for r in rows if not r.ok]
    assert not bad, bad


def _op_then_loss(op: onnx.NodeProto, y_shape: list[int], inits: dict[str, np.ndarray],
                  inputs: list[onnx.ValueInfoProto] | None = None, seed: int = 1,
                  extra: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """`op` (output "y") then loss = ReduceSum(y * R)."""
    rng = np.random.default_rng(seed)
    r = numpy_helper.from_array(rng.standard_normal(y_shape).astype(np.float32), "R")
    nodes = (extra or []) + [op,
                             helper.make_node("Constant", [], ["R"], value=r, name="r"),
                             helper.make_node("Mul", ["y", "R"], ["yr"], name="mul"),
                             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0, name="sum")]
    return make_model(nodes, inputs or [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


SOFTMAX = [("Softmax", 1), ("Softmax", -1), ("LogSoftmax", -1), ("LogSoftmax", 0)]
MASKED_SHAPES = [[2, 3, 16], [2, 3, 10]]


def _softmax_case(op_type: str, axis: int, seed: int) -> onnx.ModelProto:
    op = helper.make_node(op_type, ["x"], ["y"], axis=axis, name="sm")
    return _op_then_loss(op, [3, 5, 6], {"x": _randn(3, 5, 6, seed=seed, scale=2.0)}, seed=seed + 1)


def _masked_rows_case(shape: list[int], seed: int) -> onnx.ModelProto:
    x = _randn(*shape, seed=seed, scale=3.0)
    x[..., 1::4] = x[..., 2::4] = -np.inf
    x[1, 2, 1:] = -np.inf
    op = helper.make_node("Softmax", ["x"], ["y"], axis=-1, name="sm")
    return _op_then_loss(op, shape, {"x": x}, seed=seed + 1)


def _register() -> None:
    """Every merged case, each drawing its values with seeds of its own (10 apart)."""
    builders: list[tuple[str, Callable[..., onnx.ModelProto], list[tuple]]] = [
        ("softmax", _softmax_case, SOFTMAX), ("masked", _masked_rows_case, [(s,) for s in MASKED_SHAPES]),
        ("lninput", _layer_norm_of_input_case, [(s,) for s in LN_INPUT_SHAPES]), ("ln", _layer_norm_case, LN_CASES),
        ("avgpool", _average_pool_case, AVERAGE_POOLS), ("maxpool", _max_pool_case, MAX_POOLS),
        ("gather", _gather_case, [()]), ("scatter", _scatter_case, [()]),
        ("scattergrad", _scatter_gradient_case, SCATTER_GRADIENTS)]
    for prefix, build, params in builders:
        for index, args in enumerate(params):
            MERGED.add(prefix if args == () else f"{prefix}{index}", build(*args, seed=10 * len(MERGED.models)))
    for o, op_type in enumerate(REDUCE_OPS):
        for r, (shape, axes) in enumerate(REDUCTIONS):
            MERGED.add(f"reduce{o}x{r}", _reduction_case(op_type, shape, axes, seed=10 * len(MERGED.models)))
    MERGED.add("viewreduce", _view_reductions_case(seed=10 * len(MERGED.models)))


@MERGED_GROUP
@pytest.mark.parametrize("op_type,axis", SOFTMAX)
def test_softmax(merged_folder, op_type: str, axis: int) -> None:
    MERGED.check(f"softmax{SOFTMAX.index((op_type, axis))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("shape", MASKED_SHAPES)
def test_softmax_masked_rows(merged_folder, shape: list[int]) -> None:
    """Rows with -inf entries (an attention mask): reduce.py folds a row's texels into float4 (max, sum) pairs,
    a lane outside the row as -inf, and joins the components. Here whole components of a row are -inf (columns
    1 and 2 mod 4), and one row has a single finite entry; onnxruntime's softmax is the reference."""
    MERGED.check(f"masked{MASKED_SHAPES.index(shape)}", merged_folder)


def _step_on_device(tmp_path, model: onnx.ModelProto, name: str) -> tuple[float, np.ndarray]:
    """(loss, value `name`) after one step on PoCL of `model`, which has no inputs."""
    from fblc.codegen.compile import compile_model
    from fblc.runtime.local import LocalRunner

    path, bundle = str(tmp_path / "direct.onnx"), str(tmp_path / "direct.bundle")
    onnx.save(model, path)
    compile_model(path, bundle, "local", "fp32", TrainingOptions(loss="output", optimizer=SGD))
    runner = LocalRunner(bundle, storage="image")
    loss = runner.step({})
    return loss, runner.read_before_swap(name)


# (op, shape, axis): split_softmax makes every softmax a ReduceLogSumExp (reduce.py) and a map; the rows
# take the reduction's paths
SOFTMAX_ROWS = [
    ("Softmax", [2, 3, 16], -1),  # innermost, a multiple of 4: the row read as whole texels
    ("LogSoftmax", [2, 3, 16], 2),
    ("Softmax", [3, 288], -1),
    ("LogSoftmax", [3, 288], 1),
    ("Softmax", [2, 3, 10], -1),  # innermost, not a multiple of 4: element reads
    ("LogSoftmax", [3, 7], -1),
    ("Softmax", [2, 5, 8], 1),  # not innermost: strided element reads
    ("LogSoftmax", [3, 4, 4], 0),
    ("Softmax", [70, 4], 0),
    ("LogSoftmax", [70, 4], -2),
    ("Softmax", [2, 5, 6], 1),
    ("Softmax", [2, 1030], -1),  # past the serial limit: a work-group per row, partials merged in __local
    ("LogSoftmax", [2, 2048], -1),  # a vocabulary-sized row of whole texels, a work-group per row
]


@pytest.mark.parametrize("op_type,shape,axis", SOFTMAX_ROWS)
def test_softmax_rows(tmp_path, op_type: str, shape: list[int], axis: int) -> None:
    """Against onnxruntime, then against float64 numpy: the loss sum(y * R) and dloss/dx.

    x is offset by 20 (and spread by 4) so that an exp without the max subtracted would overflow
    no less than it would lose precision; the tolerances are a few fp32 roundings.
    """
    x = _randn(*shape, scale=4.0) + 20.0
    model = _op_then_loss(helper.make_node(op_type, ["x"], ["y"], axis=axis, name="sm"), shape, {"x": x})
    _check(tmp_path, model)
    r = next(numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.name == "r").astype(np.float64)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    y = e / e.sum(axis=axis, keepdims=True)
    if op_type == "Softmax":
        expected_loss = (y * r).sum()
        expected_grad = y * (r - (r * y).sum(axis=axis, keepdims=True))
    else:
        expected_loss = (np.log(y) * r).sum()
        expected_grad = r - y * r.sum(axis=axis, keepdims=True)
    loss, grad = _step_on_device(tmp_path, model, "x.grad")
    assert abs(loss - expected_loss) <= 1e-5 * np.abs(r).sum(), (loss, expected_loss)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=2e-6)


LN_INPUT_SHAPES = [[2, 3, 8], [2, 3, 6], [3, 288]]
LN_CASES = [([2, 3, 4, 6], -1), ([2, 3, 4, 6], -2), ([2, 3, 8], -1), ([3, 288], -1)]
AVERAGE_POOLS = [([0, 0, 0, 0], 0), ([1, 1, 1, 1], 0), ([1, 0, 1, 1], 1)]
MAX_POOLS = [([1, 1, 1, 1], [1, 1], [1, 1]), ([1, 0, 0, 1], [2, 1], [1, 2])]


def _layer_norm_of_input_case(shape: list[int], seed: int) -> onnx.ModelProto:
    inner = shape[-1]
    extra = [helper.make_node("Constant", [], ["scale"],
                              value=numpy_helper.from_array(_randn(inner, seed=seed + 2) + 1.0), name="scale"),
             helper.make_node("Constant", [], ["bias"], value=numpy_helper.from_array(_randn(inner, seed=seed + 3)),
                              name="bias"),
             helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1, epsilon=1e-5, name="ln")]
    op = helper.make_node("Mul", ["n", "w"], ["y"], name="weight")
    return _op_then_loss(op, shape, {"w": _randn(*shape, seed=seed + 4)}, extra=extra, seed=seed + 1,
                         inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)])


def _layer_norm_case(shape: list[int], axis: int, seed: int) -> onnx.ModelProto:
    norm_shape = shape[axis:]
    op = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=axis, epsilon=1e-5, name="ln")
    inits = {"x": _randn(*shape, seed=seed, scale=3.0) + 1.5, "scale": _randn(*norm_shape, seed=seed + 2) + 1.0,
             "bias": _randn(*norm_shape, seed=seed + 3)}
    return _op_then_loss(op, shape, inits, seed=seed + 1)


def _average_pool_case(pads: list[int], include: int, seed: int) -> onnx.ModelProto:
    op = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=pads,
                          count_include_pad=include, name="pool")
    h_out = (7 + pads[0] + pads[2] - 3) // 2 + 1
    w_out = (8 + pads[1] + pads[3] - 3) // 2 + 1
    return _op_then_loss(op, [2, 3, h_out, w_out], {"x": _randn(2, 3, 7, 8, seed=seed)}, seed=seed + 1)


def _max_pool_case(pads: list[int], strides: list[int], dilations: list[int], seed: int) -> onnx.ModelProto:
    op = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 2], strides=strides, pads=pads,
                          dilations=dilations, name="pool")
    dims = [(n + pads[a] + pads[a + 2] - ((k - 1) * d + 1)) // s + 1
            for a, (n, k, s, d) in enumerate(zip([6, 7], [3, 2], strides, dilations))]
    return _op_then_loss(op, [2, 3, *dims], {"x": _randn(2, 3, 6, 7, seed=seed)}, seed=seed + 1)


@MERGED_GROUP
@pytest.mark.parametrize("shape", LN_INPUT_SHAPES)
def test_layer_norm_without_statistics(merged_folder, shape: list[int]) -> None:
    """LayerNormalization of a model input (no gradient reaches it, so no Mean/InvStdDev outputs):
    the Y kernel computes the row statistics itself, in its prologue when the row is whole texels."""
    MERGED.check(f"lninput{LN_INPUT_SHAPES.index(shape)}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("shape,axis", LN_CASES)
def test_layer_norm(merged_folder, shape: list[int], axis: int) -> None:
    MERGED.check(f"ln{LN_CASES.index((shape, axis))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("pads,include", AVERAGE_POOLS)
def test_average_pool(merged_folder, pads: list[int], include: int) -> None:
    MERGED.check(f"avgpool{AVERAGE_POOLS.index((pads, include))}", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("pads,strides,dilations", MAX_POOLS)
def test_max_pool(merged_folder, pads: list[int], strides: list[int], dilations: list[int]) -> None:
    MERGED.check(f"maxpool{MAX_POOLS.index((pads, strides, dilations))}", merged_folder)


@pytest.mark.parametrize("width", [4, 8, 6])
def test_embedding_with_repeated_ids(tmp_path, width: int, monkeypatch) -> None:
    """Gather of a [5, width] table by [3, 8] ids: 24 ids over 5 rows repeat, so the scatter must add.
    With no room for a one-hot the gradient is a ScatterElements of whole rows (segment_sum.py): rows
    of 4 and 8 take the whole-texel path (a work-item folds 1 or 2 texels of a row), 6 the per-lane one."""
    from fblc.compiler.gradients import segment_sum

    monkeypatch.setattr(segment_sum, "ONE_HOT_ELEMENTS", 0)
    op = helper.make_node("Gather", ["table", "ids"], ["y"], axis=0, name="embed")
    model = _op_then_loss(op, [3, 8, width], {"table": _randn(5, width)},
                          inputs=[helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 8])])
    _check(tmp_path, model)
    from fblc.codegen import ir as kir
    from tests.support.kernel_ir import lowered_kernels, of_type

    kernels = lowered_kernels(str(tmp_path / "model.onnx"), "local", "fp32", TrainingOptions(loss="output", optimizer=SGD))
    scatter = next(k for k in kernels if k.name.endswith("_ScatterElements"))
    texel_accumulators = [a for a in of_type(scatter, kir.DeclareArray) if a.var.dtype == kir.FLOAT4]
    assert bool(texel_accumulators) == (width % 4 == 0)


def _gather_case(seed: int) -> onnx.ModelProto:
    idx = numpy_helper.from_array(np.array([[2, -1], [0, 0]], np.int64), "idx")
    extra = [helper.make_node("Constant", [], ["idx"], value=idx, name="idx"),
             helper.make_node("Gather", ["x", "idx"], ["g"], axis=1, name="gather")]
    op = helper.make_node("Mul", ["g", "w"], ["y"], name="scale")
    return _op_then_loss(op, [3, 2, 2, 2], {"w": _randn(2, 2, 2, seed=seed)}, extra=extra, seed=seed + 1,
                         inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 2])])


def _scatter_case(seed: int) -> onnx.ModelProto:
    nd_idx = np.array([[2, -1], [0, 1]], np.int64)
    el_idx = np.array([[[1, 1, -4], [3, 0, 3], [2, 2, 2]]] * 3, np.int64)
    extra = [helper.make_node("Constant", [], ["nd_idx"], value=numpy_helper.from_array(nd_idx), name="nd_idx"),
             helper.make_node("Constant", [], ["el_idx"], value=numpy_helper.from_array(el_idx), name="el_idx"),
             helper.make_node("ScatterND", ["x", "nd_idx", "u"], ["s"], name="scatter_nd"),
             helper.make_node("ScatterElements", ["s", "el_idx", "v"], ["e"], axis=2, reduction="add",
                              name="scatter_el")]
    op = helper.make_node("Mul", ["e", "w"], ["y"], name="scale")
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
              for name, shape in [("x", [3, 3, 4]), ("u", [2, 4]), ("v", [3, 3, 3])]]
    return _op_then_loss(op, [3, 3, 4], {"w": _randn(3, 3, 4, seed=seed)}, inputs=inputs, extra=extra, seed=seed + 1)


#: (reduction, ScatterND's tuples, ScatterElements' axis): the gradient cases, data and updates trained
SCATTER_GRADIENTS = [("none", [[2, -1], [0, 1]], 1), ("add", [[1], [-2], [2]], 0)]


def _scatter_gradient_case(reduction: str, tuples: list[list[int]], axis: int, seed: int) -> onnx.ModelProto:
    """ScatterND then ScatterElements, both with `reduction`, every float operand trained: the backward runs
    GatherND / GatherElements for the updates and, for "none", the scatters of zeros into dy for the data.
    With "none" no position is written twice (the forward's winner would be undefined); with "add" tuples 1
    and -2 name one row and the ScatterElements indices repeat along `axis`."""
    nd_idx = np.array(tuples, np.int64)
    shape = [3, 3, 4]
    el_shape = [2, 2, 4] if axis == 0 else [3, 2, 4]
    el_idx = np.empty(el_shape, np.int64)
    el_idx[:, 0], el_idx[:, 1] = (-1, 0) if reduction == "none" else (2, -1)
    if axis == 0:
        el_idx = np.broadcast_to(np.array([[[-3, 1, 0, 2]], [[0, 0, -1, 1]]]), el_shape).copy()
    extra = [helper.make_node("Constant", [], ["nd_idx"], value=numpy_helper.from_array(nd_idx), name="nd_idx"),
             helper.make_node("Constant", [], ["el_idx"], value=numpy_helper.from_array(el_idx), name="el_idx"),
             helper.make_node("ScatterND", ["x", "nd_idx", "u"], ["s"], name="scatter_nd", reduction=reduction),
             helper.make_node("ScatterElements", ["s", "el_idx", "v"], ["e"], axis=axis, reduction=reduction,
                              name="scatter_el")]
    op = helper.make_node("Mul", ["e", "w"], ["y"], name="scale")
    u_shape = [len(tuples), *shape[len(tuples[0]):]]
    inits = {"x": _randn(*shape, seed=seed), "u": _randn(*u_shape, seed=seed + 2),
             "v": _randn(*el_shape, seed=seed + 3), "w": _randn(*shape, seed=seed + 4)}
    return _op_then_loss(op, shape, inits, extra=extra, seed=seed + 1)


@MERGED_GROUP
@pytest.mark.parametrize("reduction,tuples,axis", SCATTER_GRADIENTS)
def test_scatter_gradients(merged_folder, reduction: str, tuples: list[list[int]], axis: int) -> None:
    """The scatters' gradients on the device (fblc/compiler/gradients/scatter.py) against onnxruntime."""
    MERGED.check(f"scattergrad{SCATTER_GRADIENTS.index((reduction, tuples, axis))}", merged_folder)


@MERGED_GROUP
def test_gather_inner_axis_negative_index(merged_folder) -> None:
    """Gather along axis 1 of an input (not trained) with constant indices, one negative."""
    MERGED.check("gather", merged_folder)


@MERGED_GROUP
def test_scatter_forward(merged_folder) -> None:
    """ScatterND (replace, a negative index) into ScatterElements (add, repeated targets) as forward ops."""
    MERGED.check("scatter", merged_folder)


@pytest.mark.parametrize("label_shape", [[6], [2, 3]])
def test_cross_entropy(tmp_path, label_shape: list[int]) -> None:
    """logits = x @ W + b, then loss=cross_entropy: LogSoftmax, GatherElements and ScatterElements."""
    in_shape = [*label_shape, 5]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
             helper.make_node("Add", ["m", "b"], ["logits"], name="bias")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                       [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*label_shape, 7])],
                       {"w": _randn(5, 7, seed=5), "b": _randn(7, seed=6)})
    _check(tmp_path, model, loss="cross_entropy")


REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax"]
REDUCTIONS = [([3, 4, 16], [2]), ([3, 4, 16], [1, 2]), ([3, 4, 6], [2]), ([3, 8, 4], [1]), ([5, 3, 8], [0, 2]),
              ([6, 3, 8], [0, 1]), ([3, 5, 6], [1])]


def _reduction_case(op_type: str, shape: list[int], axes: list[int], seed: int) -> onnx.ModelProto:
    out = [1 if a in axes else d for a, d in enumerate(shape)]
    axes_init = numpy_helper.from_array(np.array(axes, dtype=np.int64), "axes")
    op = helper.make_node(op_type, ["x", "axes"], ["y"], keepdims=1, name="reduce")
    return _op_then_loss(op, out, {"x": _randn(*shape, seed=seed, scale=2.0)}, seed=seed + 1, extra=[
        helper.make_node("Constant", [], ["axes"], value=axes_init, name="axes")])


#: reductions of transposed and reshaped views (tile_remap reads them through their roots): (op, root shape, perm,
#: view shape, axes). Heads merged after a transpose (the kept 24 folded: a row mapped once, then root strides); a
#: window reverse's rows permuted with the kept 8 the root's trailing run (the root folded as [N / 8, 8] rows).
VIEW_REDUCTIONS = [("ReduceSum", [2, 3, 4, 8], [0, 2, 1, 3], [2, 4, 24], [0, 1]),
                   ("ReduceMax", [4, 2, 2, 8], [0, 2, 1, 3], [8, 2, 8], [0, 1])]


def _view_reductions_case(seed: int) -> onnx.ModelProto:
    """Every VIEW_REDUCTIONS entry k of its own initializer x<k>, loss = sum_k ReduceSum(y<k> * R<k>): one case."""
    rng = np.random.default_rng(seed + 1)
    nodes, inits, losses = [], {}, []
    for k, (op_type, shape, perm, view, axes) in enumerate(VIEW_REDUCTIONS):
        out = [1 if a in axes else d for a, d in enumerate(view)]
        consts = {f"axes{k}": np.array(axes, dtype=np.int64), f"view{k}": np.array(view, dtype=np.int64),
                  f"R{k}": rng.standard_normal(out).astype(np.float32)}
        nodes += [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(v, n), name=n)
                  for n, v in consts.items()]
        nodes += [helper.make_node("Transpose", [f"x{k}"], [f"t{k}"], perm=perm, name=f"transpose{k}"),
                  helper.make_node("Reshape", [f"t{k}", f"view{k}"], [f"v{k}"], name=f"reshape{k}"),
                  helper.make_node(op_type, [f"v{k}", f"axes{k}"], [f"y{k}"], keepdims=1, name=f"reduce{k}"),
                  helper.make_node("Mul", [f"y{k}", f"R{k}"], [f"yr{k}"], name=f"mul{k}"),
                  helper.make_node("ReduceSum", [f"yr{k}"], [f"loss{k}"], keepdims=0, name=f"sum{k}")]
        inits[f"x{k}"], losses = _randn(*shape, seed=seed + k, scale=2.0), losses + [f"loss{k}"]
    nodes.append(helper.make_node("Sum", losses, ["loss"], name="losses"))
    return make_model(nodes, [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)


@MERGED_GROUP
def test_reductions_of_views(merged_folder) -> None:
    """Reductions of strided views equal onnxruntime's in both of the forms that read the root (reduce.py:
    root_steps, root_columns), with a sum and a max."""
    MERGED.check("viewreduce", merged_folder)


@MERGED_GROUP
@pytest.mark.parametrize("op_type", REDUCE_OPS)
@pytest.mark.parametrize("shape,axes", REDUCTIONS)
def test_reductions(merged_folder, op_type: str, shape: list[int], axes: list[int]) -> None:
    """Innermost runs of whole texels (16, 4x16; 8 under an outer axis: a BatchNorm gradient) read
    texels and fold their lanes; kept inner runs of 4 or 8 (a bias gradient) fold a texel's lanes
    together; others (6, a middle axis before 6) read elements."""
    MERGED.check(f"reduce{REDUCE_OPS.index(op_type)}x{REDUCTIONS.index((shape, axes))}", merged_folder)


def test_total_reductions_of_three_shapes_in_one_kernel(tmp_path) -> None:
    """Sums over whole tensors of 15, 2,560 and 7 elements (the finite check's form: fuse folds total
    reductions of one stage in one kernel, the longest deciding its work-group, schedules.py) and their sum:
    the step, gradients and updates equal onnxruntime's (verify's tolerance), in image storage (buffer storage
    runs such a kernel in test_mixed_precision's skipped-step test)."""
    target, storage = "adreno830", "image"
    from fblc.codegen.compile import compile_model

    rng = np.random.default_rng(5)
    shapes = {"a": (3, 5), "b": (40, 64), "c": (7,)}
    nodes = [helper.make_node("ReduceSum", [x], [f"s{x}"], keepdims=0) for x in shapes]
    nodes += [helper.make_node("Add", ["sa", "sb"], ["ab"]), helper.make_node("Mul", ["ab", "sc"], ["y"]),
              helper.make_node("Mul", ["y", "y"], ["out"])]
    path = str(tmp_path / "totals.onnx")
    onnx.save(make_model(nodes, [], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])],
                         {x: rng.standard_normal(s).astype(np.float32) * 0.1 for x, s in shapes.items()}), path)
    options = TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1))
    step, _ = compile_model(path, str(tmp_path / "bundle"), target, "fp32", options)
    sums = {n.metadata_props["fblc.kernel"] for n in step.graph if n.op_type == "ReduceSum"
            and n.inputs[0].name in shapes}
    assert len(sums) == 1, sums
    rows = verify_model(path, options, target=target, storage=storage)
    assert rows and all(r.ok for r in rows), [(r.name, r.max_abs) for r in rows if not r.ok]


_register()
