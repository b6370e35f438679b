"""Gather (any axis) and GatherND gradients against PyTorch autograd, at any onnxruntime thread count.

The harness is test_gradient_rules.py's: a tiny opset-18 model, the op on trainable
initializers, loss ReduceSum(y * R); the step's loss and gradients must match float64 torch
autograd (RTOL 1e-4, ATOL 1e-5). Constant indices (folded at import: the rule computes their
row numbers) go through its `check`; indices fed as a model input (token ids) through
`check_fed`, which runs the step with 1, 2 and 4 threads and wants the same bits from each.
The segment sum has three forms (fblc/compiler/gradients/segment_sum.py): Pad for a constant
run of rows, a one-hot MatMul while it is small, ScatterElements beyond; the `scatter` runs
lower ONE_HOT_ELEMENTS to reach the last one on tiny shapes. One step of each on PoCL against
onnxruntime, for adreno830 under both layouts, is at the end (one merged step per layout and form:
tests/support/merged_steps.py).
"""

from __future__ import annotations

import pathlib
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler.autodiff import supported_ops
from fblc.compiler.gradients import segment_sum
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from tests.support import merged_steps
from tests.test_gradient_rules import ATOL, OPSET, RTOL, Case, check, i64, node, rand

Tensors = dict[str, torch.Tensor]
Index = np.ndarray | Sequence[object] | int
THREADS = (1, 2, 4)
FORMS = ("default", "scatter")
#: the op that sums each form's repeated rows (none for a constant run: Pad, or dy itself)
FORM_OPS = {"run": set(), "default": {"MatMul"}, "scatter": {"ScatterElements"}}


@pytest.fixture
def form(request, monkeypatch) -> str:
    """`scatter`: no one-hot is small enough, so every non-run segment sum is a ScatterElements."""
    if request.param == "scatter":
        monkeypatch.setattr(segment_sum, "ONE_HOT_ELEMENTS", 0)
    return request.param


def assert_form(step_path: pathlib.Path, form: str) -> None:
    """The step sums the rows with the op of `form`, and never with onnxruntime's racy ScatterND."""
    ops = {n.op_type for n in onnx.load(str(step_path)).graph.node} & {"ScatterND", "ScatterElements", "MatMul"}
    assert ops == FORM_OPS[form], f"{step_path}: summed with {sorted(ops)}, not {sorted(FORM_OPS[form])}"


def wrapped(index: torch.Tensor | np.ndarray, size: int) -> torch.Tensor:
    """ONNX's negative indices, counted from the end, as torch's non-negative ones."""
    return torch.as_tensor(index) % size


def take(x: torch.Tensor, axis: int, index: torch.Tensor) -> torch.Tensor:
    """ONNX Gather: x[.., index, ..] at `axis`, index of any rank (a scalar drops the axis)."""
    axis %= x.dim()
    return x[(slice(None),) * axis + (wrapped(index, x.shape[axis]),)]


def gather_nd(x: torch.Tensor, index: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """ONNX GatherND, by advanced indexing of each batch element."""
    lead, k = x.shape[:batch_dims], index.shape[-1]
    flat_x = x.reshape(-1, *x.shape[batch_dims:])
    flat_index = torch.as_tensor(index).reshape(flat_x.shape[0], -1, k)
    picked = [flat_x[b][tuple(wrapped(flat_index[b, :, j], flat_x.shape[1 + j]) for j in range(k))]
              for b in range(flat_x.shape[0])]
    return torch.stack(picked).reshape(*lead, *index.shape[batch_dims:-1], *x.shape[batch_dims + k:])


# ---------------------------------------------------------------- constant indices

def gather(label: str, shape: tuple[int, ...], axis: int, index: Index) -> Case:
    return Case(f"Gather-{label}", [node("Gather", ["x", "idx"], axis=axis)], {"x": rand(*shape)},
                lambda t: take(t["x"], axis, t["idx"]), consts={"idx": i64(index)})


def gather_nd_case(label: str, shape: tuple[int, ...], index: Index, batch_dims: int = 0) -> Case:
    return Case(f"GatherND-{label}", [node("GatherND", ["x", "idx"], batch_dims=batch_dims)], {"x": rand(*shape)},
                lambda t: gather_nd(t["x"], t["idx"], batch_dims), consts={"idx": i64(index)})


RUN_CASES = [  # rows a constant run: the Pad form whatever the one-hot budget
    gather("axis1-scalar-cls", (2, 5, 3), 1, 0),  # h[:, 0]
    gather("axis-1-scalar-negative", (2, 3, 4), -1, -2),
    gather("axis-2-scalar-fused-qkv", (2, 4, 3, 6), -2, 1),  # qkv[..., 1, :]
    gather("axis1-run", (2, 6, 3), 1, [1, 2, 3]),
    gather("axis0-every-row", (3, 4), 0, [0, 1, 2]),
    gather("axis0-scalar-in-matrix", (5, 3), 0, [[2]]),
    gather_nd_case("batch1-same-run-in-every-batch", (3, 4, 2), [[[1], [2]]] * 3, batch_dims=1),
]
REPEATED_CASES = [  # repeated and negative indices: the one-hot form, or the scatter one
    gather("axis1-repeated-negative", (3, 5, 4), 1, [[0, -1, 2], [2, 2, -5]]),  # N = 6 > 5 rows
    gather("axis2-index-matrix", (2, 3, 4, 2), 2, [[3, 3], [0, -4], [1, 3]]),
    gather("axis-1-bias-table", (2, 9), -1, [[4, 3], [4, 4], [0, 8]]),  # bias[:, idxs]
    gather_nd_case("k1-repeated-negative", (4, 3, 5), [[1], [-1], [1], [3]]),
    gather_nd_case("k2", (4, 3, 5), [[0, 1], [3, -1], [0, 1]]),
    gather_nd_case("k3-elements", (2, 3, 4), [[1, 2, 3], [0, 0, 0], [1, 2, -1], [-1, -1, -1]]),
    gather_nd_case("index-matrix", (5, 3), [[[3], [-2], [0]], [[3], [3], [1]]]),  # x[[..], :]
    gather_nd_case("batch1-k1", (2, 4, 3), [[[1], [3], [1]], [[0], [-1], [0]]], batch_dims=1),
    gather_nd_case("batch1-k2", (2, 3, 4, 5), [[[0, 1], [2, -1]], [[1, 1], [1, 1]]], batch_dims=1),
    gather_nd_case("batch2", (2, 3, 4, 5), np.array([[[[3], [0]], [[1], [1]], [[-1], [2]]]] * 2), batch_dims=2),
]


@pytest.mark.parametrize("case", [c.param() for c in RUN_CASES])
def test_gather_gradient_constant_run(case: Case, tmp_path) -> None:
    check(case, tmp_path)
    assert_form(tmp_path / "step.onnx", "run")


@pytest.mark.parametrize("form", FORMS, indirect=True)
@pytest.mark.parametrize("case", [c.param() for c in REPEATED_CASES])
def test_gather_gradient_repeated_indices(case: Case, form: str, tmp_path) -> None:
    check(case, tmp_path)
    assert_form(tmp_path / "step.onnx", form)


def test_gather_nd_rule_has_cases_here() -> None:
    """test_gradient_rules.py's coverage check reads only its own cases: GatherND's are here."""
    assert "GatherND" in supported_ops()
    assert "GatherND" in {n.op_type for c in RUN_CASES + REPEATED_CASES for n in c.nodes}


# ---------------------------------------------------------------- fed indices, several threads

def _model(nodes: list[onnx.NodeProto], params: dict[str, np.ndarray], fed: dict[str, np.ndarray],
           r: np.ndarray) -> onnx.ModelProto:
    tail = [helper.make_node("Constant", [], ["R"], value=numpy_helper.from_array(r, "R")),
            helper.make_node("Mul", ["y", "R"], ["weighted"]),
            helper.make_node("ReduceSum", ["weighted"], ["total"], keepdims=0)]
    inputs = [helper.make_tensor_value_info(k, TensorProto.INT64, list(v.shape)) for k, v in fed.items()]
    outputs = [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])]
    graph = helper.make_graph(nodes + tail, "fed", inputs, outputs,
                              initializer=[numpy_helper.from_array(v, k) for k, v in params.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)


def _run(step_path: str, feeds: dict[str, np.ndarray], threads: int, repeats: int) -> list[dict[str, np.ndarray]]:
    """`repeats` runs of the step with `threads` intra-op threads (a race shows in some runs only)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(step_path, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
    return [dict(zip(names, session.run(None, feeds))) for _ in range(repeats)]


def check_fed(label: str, nodes: list[onnx.NodeProto], params: dict[str, np.ndarray], fed: dict[str, np.ndarray],
              reference: Callable[[Tensors], torch.Tensor], folder: pathlib.Path, form: str, repeats: int = 2,
              atol: float = ATOL) -> None:
    """The step of `nodes` with `fed` as model inputs, at every thread count of THREADS: the gradients
    of torch autograd, and bit for bit the same from every run; summed in the form `form`."""
    tensors = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in params.items()}
    y = reference({**tensors, **{k: torch.from_numpy(v) for k, v in fed.items()}})
    r = np.random.default_rng(zlib.crc32(label.encode())).uniform(-1, 1, tuple(y.shape)).astype(np.float32)
    (y * torch.from_numpy(r.astype(np.float64))).sum().backward()
    onnx.save(_model(nodes, params, fed, r), str(folder / "model.onnx"))
    options = TrainingOptions(loss="output", optimizer=OptimizerConfig(name="sgd", lr=0.0))
    step_path = str(folder / "step.onnx")
    save_model_atomically(build_training_graph(load_model(str(folder / "model.onnx")), options), step_path)
    assert_form(pathlib.Path(step_path), form)
    feeds = {**fed, **params}
    first = _run(step_path, feeds, 1, 1)[0]
    for name, tensor in tensors.items():
        np.testing.assert_allclose(first[f"{name}.grad"], tensor.grad.numpy(), rtol=RTOL, atol=atol,
                                   err_msg=f"{label}: gradient of {name}, 1 thread")
    for threads in THREADS[1:]:
        for k, got in enumerate(_run(step_path, feeds, threads, repeats)):
            for name in tensors:
                np.testing.assert_array_equal(got[f"{name}.grad"], first[f"{name}.grad"],
                                              err_msg=f"{label}: gradient of {name}, {threads} threads, run {k}")


@pytest.mark.parametrize("form", FORMS, indirect=True)
def test_fed_gather_axis1(form: str, tmp_path) -> None:
    ids = i64([[4, -1, 0], [4, 2, 4]])
    check_fed("gather-axis1", [node("Gather", ["x", "ids"], axis=1)], {"x": rand(2, 5, 4)}, {"ids": ids},
              lambda t: take(t["x"], 1, t["ids"]), tmp_path, form)


@pytest.mark.parametrize("form", FORMS, indirect=True)
def test_fed_gather_scalar_index(form: str, tmp_path) -> None:
    check_fed("gather-scalar", [node("Gather", ["x", "ids"], axis=-2)], {"x": rand(3, 4, 2)}, {"ids": i64(-3)},
              lambda t: take(t["x"], -2, t["ids"]), tmp_path, form)


@pytest.mark.parametrize("form", FORMS, indirect=True)
def test_fed_gather_nd_batch_dims(form: str, tmp_path) -> None:
    ids = i64([[[0, 1], [2, -1], [0, 1]], [[-3, 0], [1, 1], [1, 1]]])
    check_fed("gather-nd-batch1", [node("GatherND", ["x", "ids"], batch_dims=1)], {"x": rand(2, 3, 4, 2)},
              {"ids": ids}, lambda t: gather_nd(t["x"], t["ids"], 1), tmp_path, form)


@pytest.mark.parametrize("form", FORMS, indirect=True)
def test_embedding_gradient_is_race_free_at_any_thread_count(form: str, tmp_path) -> None:
    """4096 token ids over 2 rows of a [4, 1024] table. The old ScatterND(reduction="add") loses
    updates in onnxruntime with 2 or 4 threads in most runs and sums in another order in the rest:
    8 runs of each failed it 10 times out of 10. The one-hot and scatter forms must give one set of
    bits at every count; onnxruntime runs ScatterElements in one thread, slowly (4M updates): 2 runs.
    A row sums 2048 updates in fp32: atol 1e-3 for that, far below a lost update (about 1)."""
    ids = np.random.default_rng(3).integers(-4, -2, size=4096).astype(np.int64)  # rows 0 and 1, as negatives
    check_fed("embedding-race", [node("Gather", ["table", "ids"], axis=0)], {"table": rand(4, 1024)}, {"ids": ids},
              lambda t: take(t["table"], 0, t["ids"]), tmp_path, form, repeats=8 if form == "default" else 2,
              atol=1e-3)


# ---------------------------------------------------------------- one step on the device

DEVICE_CASES = {  # name: (nodes, params, fed inputs, constants, y shape)
    # Pad: h[:, -2], pads on both sides
    "gather-axis1-scalar": ([node("Gather", ["x", "pick"], axis=1)], {"x": rand(2, 5, 8)}, {}, {"pick": i64(-2)},
                            (2, 8)),
    # fed ids, repeated and negative: one-hot (Equal, Cast, MatMul), or 6 updates scattered over 5 rows
    # (ScatterElements into 6 rows, sliced), whole rows of 8 (two texels)
    "gather-axis1-fed": ([node("Gather", ["x", "ids"], axis=1)], {"x": rand(2, 5, 8)},
                         {"ids": i64([[4, -1, 0], [4, 2, 4]])}, {}, (2, 2, 3, 8)),
    # the GatherND kernel, constant 2-tuples into 12 rows of 5 (the scatter's per-lane path)
    "gather-nd-k2": ([node("GatherND", ["x", "idx"])], {"x": rand(4, 3, 5)}, {},
                     {"idx": i64([[0, 1], [3, -1], [0, 1]])}, (3, 5)),
    # batch_dims 1, fed tuples: the row offsets computed on the device (Slice, Where, Mul, Add)
    "gather-nd-batch1-fed": ([node("GatherND", ["x", "ids"], batch_dims=1)], {"x": rand(2, 3, 4, 8)},
                             {"ids": i64([[[0, 1], [2, -1], [0, 1]], [[-3, 0], [1, 1], [1, 1]]])}, {}, (2, 3, 8)),
}
DEVICE_RUNS = [("gather-axis1-scalar", "default")] + [(name, form) for name in list(DEVICE_CASES)[1:] for form in FORMS]


LAYOUTS = ["rtile", "naive"]


def _device_model(name: str) -> onnx.ModelProto:
    nodes, params, fed, consts, y_shape = DEVICE_CASES[name]
    constants = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v, k)) for k, v in consts.items()]
    r = np.random.default_rng(7).standard_normal(y_shape).astype(np.float32)
    return _model(constants + nodes, params, fed, r)


#: case id (a prefix of its values' names in a merged step) of each device case
DEVICE_IDS = {name: f"case{index}" for index, name in enumerate(DEVICE_CASES)}
#: (layout, form) -> that form's device runs, one merged step (tests/support/merged_steps.py: one PoCL build, each
#: case judged on its own rows); a step holds one form's cases, since the first test of it builds it under its
#: `form` fixture's ONE_HOT_ELEMENTS
MERGED = {(layout, form): merged_steps.MergedCases(
    TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1), layout=layout), target="adreno830")
    for layout in LAYOUTS for form in FORMS}
for (_layout, _form), _merged in MERGED.items():
    for _name in [name for name, form in DEVICE_RUNS if form == _form]:
        _merged.add(DEVICE_IDS[_name], _device_model(_name), DEVICE_CASES[_name][2])


@pytest.mark.xdist_group("gather-device-merged")  # one worker builds the merged steps for all these tests
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,form", DEVICE_RUNS, indirect=["form"])
def test_one_step_on_pocl_matches_onnxruntime(name: str, form: str, layout: str, merged_folder) -> None:
    """Compiled for adreno830, one SGD step on PoCL against onnxruntime (fblc.tools.verify)."""
    MERGED[layout, form].check(DEVICE_IDS[name], merged_folder)
