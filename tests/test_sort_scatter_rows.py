"""sort_scatter_rows: a long row scatter (a gather's gradient) sorts its row numbers, then binary-searches them.

Golden: the embedding gradient's ScatterElements becomes Reshape, ceil(log2 N) MergeRuns (runs 1, 2,
4, ..; the first without positions) and ScatterSortedRows, which reads no zero table; so does
GatherElements' gradient along the last axis, a line at a time. Negative: a line of at most
SORTED_SCATTER_UPDATES updates, and a scatter that is not of whole rows, stay as they are. Numeric:
the device's sorted scatter equals numpy's in-order np.add.at bit for bit (a stable sort keeps
update order), and one step of fed, repeated and negative ids equals onnxruntime under both
layouts, shared rows (an embedding) and rows per batch element (GatherND, batch_dims 1), whole-texel
rows and rows of 6; so does one step of GatherElements' and of ScatterND's (rows, and pairs of indices) forms
(all cases of one merged step per layout: tests/support/merged_steps.py).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.codegen.compile import compile_model
from fblc.compiler.gradients import segment_sum
from fblc.compiler.model_io import load_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions, build_training_graph, run_passes
from fblc.passes.sort_scatter_rows import SortScatterRows
from fblc.profiles.profile import SORTED_SCATTER_UPDATES
from fblc.runtime.local import LocalRunner
from tests.support import merged_steps

OPTIONS = TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1))


@pytest.fixture(autouse=True)
def scatter_form(monkeypatch) -> None:
    """Every non-run segment sum a ScatterElements (no one-hot is small enough), as for a real vocabulary."""
    monkeypatch.setattr(segment_sum, "ONE_HOT_ELEMENTS", 0)


def embedding(path: str, rows: int, width: int, ids_shape: tuple[int, ...], nd: bool = False) -> np.ndarray:
    """loss = sum(Gather(table, ids) * R) (or GatherND(x [B, rows, width], ids [B, N, 1], batch_dims=1)); returns R."""
    rng = np.random.default_rng(1)
    if nd:
        batch, count = ids_shape[:2]
        table, picked = rng.standard_normal((batch, rows, width)), (batch, count, width)
        gather = helper.make_node("GatherND", ["table", "ids"], ["y"], batch_dims=1)
    else:
        table, picked = rng.standard_normal((rows, width)), (*ids_shape, width)
        gather = helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)
    r = rng.standard_normal(picked).astype(np.float32)
    graph = helper.make_graph(
        [gather, helper.make_node("Mul", ["y", "R"], ["weighted"]),
         helper.make_node("ReduceSum", ["weighted"], ["total"], keepdims=0)], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, list(ids_shape))],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(table.astype(np.float32), "table"), numpy_helper.from_array(r, "R")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)
    return r


def step_ops(path: str) -> list:
    step = build_training_graph(load_model(path), OPTIONS)
    return list(run_passes(step, [SortScatterRows()]).graph)


def test_a_long_row_scatter_becomes_a_merge_sort_and_a_sorted_scatter(tmp_path) -> None:
    path = str(tmp_path / "m.onnx")
    embedding(path, rows=50, width=8, ids_shape=(3, 100))
    before = [n.op_type for n in build_training_graph(load_model(path), OPTIONS).graph]
    nodes = step_ops(path)
    after = [n.op_type for n in nodes]
    assert before.count("ScatterElements") == 1 and "ScatterElements" not in after
    merges = [n for n in nodes if n.op_type == "MergeRuns"]
    assert [n.attributes["run"].value for n in merges] == [2 ** k for k in range(math.ceil(math.log2(300)))]
    assert len(merges[0].inputs) == 1 or merges[0].inputs[1] is None  # the first pass makes the positions
    assert all(n.inputs[1] is not None for n in merges[1:])
    scatter = next(n for n in nodes if n.op_type == "ScatterSortedRows")
    assert scatter.inputs[1] is merges[-1].outputs[0] and scatter.inputs[2] is merges[-1].outputs[1]
    assert [d for d in scatter.inputs[1].shape] == [1, 300]
    assert after.count("Expand") == before.count("Expand") - 1  # the broadcast row numbers had no other reader
    # the zero table the gradient scattered into is never made: the rows start from 0
    assert scatter.inputs[0] is None and list(scatter.attributes["shape"].value) == [1, 300, 8]
    assert after.count("ConstantOfShape") == before.count("ConstantOfShape") - 1


def test_short_lines_and_other_scatters_stay(tmp_path) -> None:
    path = str(tmp_path / "short.onnx")
    embedding(path, rows=50, width=8, ids_shape=(SORTED_SCATTER_UPDATES,))
    assert "MergeRuns" not in [n.op_type for n in step_ops(path)]
    # GatherElements' gradient along an axis with data after it scatters single elements, not rows
    path = str(tmp_path / "ge.onnx")
    gather_elements(path, (100, 2), np.random.default_rng(0).integers(0, 100, (100, 2)), axis=0)
    ops = [n.op_type for n in step_ops(path)]
    assert "ScatterElements" in ops and "MergeRuns" not in ops


def gather_elements(path: str, shape: tuple[int, ...], idx: np.ndarray, axis: int) -> None:
    """loss = sum(GatherElements(x, idx, axis) * R), x trained, idx constant."""
    rng = np.random.default_rng(7)
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["x", "idx"], ["y"], axis=axis),
         helper.make_node("Mul", ["y", "R"], ["weighted"]),
         helper.make_node("ReduceSum", ["weighted"], ["total"], keepdims=0)], "ge", [],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), "x"),
                     numpy_helper.from_array(idx.astype(np.int64), "idx"),
                     numpy_helper.from_array(rng.standard_normal(idx.shape).astype(np.float32), "R")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)


def _gather_elements_lines(path: str) -> dict[str, np.ndarray]:
    """GatherElements along the last axis: 3 x 2 lines of 90 repeated and negative indices into 30 (no feeds)."""
    gather_elements(path, (3, 2, 30), np.random.default_rng(8).integers(-30, 30, (3, 2, 90)), axis=2)
    return {}


@pytest.mark.xdist_group("sorted-rows-merged")  # its steps are cases of MERGED (below)
def test_gather_elements_along_the_last_axis_sorts_each_line(tmp_path, merged_folder) -> None:
    """GatherElements' gradient along the last axis: each line's indices sort on their own (G lines of N,
    rows of one element), and one step of repeated and negative indices equals onnxruntime's under
    both layouts (cases of the merged steps)."""
    path = str(tmp_path / "ge.onnx")
    _gather_elements_lines(path)
    nodes = step_ops(path)
    assert "ScatterElements" not in [n.op_type for n in nodes]
    assert sum(n.op_type == "MergeRuns" for n in nodes) == math.ceil(math.log2(90))
    scatter = next(n for n in nodes if n.op_type == "ScatterSortedRows")
    assert [d for d in scatter.inputs[1].shape] == [6, 90] and scatter.inputs[0] is None
    for layout in LAYOUTS:
        MERGED[layout].check(CASE_IDS["gather-elements-lines"], merged_folder)


@pytest.mark.parametrize("layout", ["rtile", "naive"])
def test_the_sorted_scatter_sums_each_row_in_update_order_bit_for_bit(layout: str, tmp_path) -> None:
    """Repeated and negative ids over a 40-row table: the table's gradient read straight after its kernel."""
    path = str(tmp_path / "m.onnx")
    ids = np.random.default_rng(2).integers(-40, 40, (3, 97)).astype(np.int64)
    r = embedding(path, rows=40, width=8, ids_shape=ids.shape)
    step, _ = compile_model(path, str(tmp_path / "bundle"), "adreno830", "fp32",
                            TrainingOptions(**{**OPTIONS.__dict__, "layout": layout}))
    scatter = next(n for n in step.graph if n.op_type == "ScatterSortedRows")
    runner = LocalRunner(str(tmp_path / "bundle"), progress=False, storage="image")
    runner.upload(runner.manifest["inputs"][0]["texture"], ids)
    texture = runner.plan["values"][scatter.outputs[0].name]
    made_by = next(i for i, k in enumerate(runner.plan["kernels"]) if texture in k["outputs"])
    for index in range(made_by + 1):
        runner.launch(index)
    expected = np.zeros((40, 8), np.float32)
    np.add.at(expected, ids.reshape(-1) % 40, r.reshape(-1, 8))  # float32, one update after another
    got = runner._read(texture).reshape(-1)[:expected.size].reshape(expected.shape)
    assert np.array_equal(got, expected), np.abs(got - expected).max()


CASES = {  # name: (rows, width, ids, GatherND)
    "embedding-whole-texels": (37, 8, np.random.default_rng(3).integers(-37, 37, (2, 70)), False),
    "embedding-rows-of-6": (20, 6, np.random.default_rng(4).integers(0, 20, (130,)), False),
    "gather-nd-rows-per-batch": (30, 8, np.random.default_rng(5).integers(-30, 30, (2, 90, 1)), True),
}


LAYOUTS = ["rtile", "naive"]


def _case_path(folder: str, name: str) -> str:
    rows, width, ids, nd = CASES[name]
    path = os.path.join(folder, f"{name}.onnx")
    embedding(path, rows, width, ids.shape, nd)
    return path


#: layout -> one merged step of CASES (tests/support/merged_steps.py: one PoCL build, each case judged on its
#: own rows), built under the autouse scatter_form of the first test that asks for it
MERGED = {layout: merged_steps.MergedCases(TrainingOptions(**{**OPTIONS.__dict__, "layout": layout}),
                                           target="adreno830") for layout in LAYOUTS}
#: the single-op steps of the tests below (the GatherElements and ScatterND forms), cases of the same merged
#: steps: name -> writes its model to a path and returns its feeds
OTHER_FORMS: dict[str, Callable[[str], dict[str, np.ndarray]]] = {}
CASE_IDS = {name: f"case{index}" for index, name in enumerate(CASES)}


@pytest.mark.xdist_group("sorted-rows-merged")  # one worker builds the merged steps for all these tests
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CASES))
def test_one_step_with_sorted_rows_matches_onnxruntime(name: str, layout: str, tmp_path, merged_folder) -> None:
    path = _case_path(str(tmp_path), name)
    options = TrainingOptions(**{**OPTIONS.__dict__, "layout": layout})
    assert "MergeRuns" in [n.op_type for n in compile_model(path, str(tmp_path / "b"), "adreno830", "fp32",
                                                           options)[0].graph]
    MERGED[layout].check(CASE_IDS[name], merged_folder)


def _scatter_nd_rows(path: str) -> dict[str, np.ndarray]:
    """index_put of 100 fed rows into a [120, 8] table (ScatterND of 1-tuples), table, rows and W trained; its ids."""
    rng = np.random.default_rng(6)
    trained = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("table", (120, 8)), ("rows", (100, 8)), ("W", (120, 8)))]
    graph = helper.make_graph(
        [helper.make_node("ScatterND", ["table", "ids", "rows"], ["y"]),
         helper.make_node("Mul", ["y", "W"], ["weighted"]),
         helper.make_node("ReduceSum", ["weighted"], ["total"], keepdims=0)], "index_put",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [100, 1])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])], initializer=trained)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)
    # distinct rows, as ONNX asks; negative ones count from the end
    return {"ids": rng.permutation(120)[:100].reshape(100, 1).astype(np.int64) - 60}


@pytest.mark.xdist_group("sorted-rows-merged")  # its steps are cases of MERGED (below)
def test_a_scatter_nd_of_rows_is_sorted_too(tmp_path, merged_folder) -> None:
    """index_put of 100 fed rows into a [120, 8] table (ScatterND of 1-tuples, reduction none, distinct rows
    as ONNX asks), table and rows trained: the forward's rows are sorted, and so are those of the table's
    gradient (the same scatter, of zeros into dy); the rows' gradient is a GatherND of dy. One step
    (W.grad is the put table) equals onnxruntime's under both layouts (cases of the merged steps)."""
    path = str(tmp_path / "put.onnx")
    _scatter_nd_rows(path)
    nodes = step_ops(path)
    assert "ScatterND" not in [n.op_type for n in nodes] and "GatherND" in [n.op_type for n in nodes]
    assert sum(n.op_type == "ScatterSortedRows" for n in nodes) == 2
    # each of the two sorts its own copy of the ids (the same keys: sharing them is not done yet)
    assert sum(n.op_type == "MergeRuns" for n in nodes) == 2 * math.ceil(math.log2(100))
    for layout in LAYOUTS:
        MERGED[layout].check(CASE_IDS["scatter-nd-rows"], merged_folder)


def _scatter_nd_pairs(path: str) -> dict[str, np.ndarray]:
    """ScatterND(add) of 100 fed 2-tuples (repeated, negative) into a constant [12, 10, 4] table; its ids."""
    rng = np.random.default_rng(9)
    constants = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
        rng.standard_normal(shape).astype(np.float32), name)) for name, shape in (("table", (12, 10, 4)),
                                                                                  ("rows", (100, 4)))]
    graph = helper.make_graph(
        constants + [helper.make_node("ScatterND", ["table", "ids", "rows"], ["y"], reduction="add"),
                     helper.make_node("Mul", ["y", "W"], ["weighted"]),
                     helper.make_node("ReduceSum", ["weighted"], ["total"], keepdims=0)], "index_add",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [100, 2])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(rng.standard_normal((12, 10, 4)).astype(np.float32), "W")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)
    return {"ids": np.stack([rng.integers(-12, 12, 100), rng.integers(-10, 10, 100)], axis=1).astype(np.int64)}


@pytest.mark.xdist_group("sorted-rows-merged")  # its steps are cases of MERGED (below)
def test_a_scatter_nd_of_pairs_sorts_their_flat_rows(tmp_path, merged_folder) -> None:
    """ScatterND(add) of 100 fed 2-tuples (repeated, negative) into a [12, 10, 4] table: the pairs become
    flat row numbers (elementwise ops), the table is seen as [120, 4]; one step equals onnxruntime's
    under both layouts (cases of the merged steps)."""
    path = str(tmp_path / "pairs.onnx")
    _scatter_nd_pairs(path)
    nodes = step_ops(path)
    assert "ScatterND" not in [n.op_type for n in nodes]
    scatter = next(n for n in nodes if n.op_type == "ScatterSortedRows")
    assert list(scatter.outputs[0].shape) == [120, 4]
    for layout in LAYOUTS:
        MERGED[layout].check(CASE_IDS["scatter-nd-pairs"], merged_folder)


OTHER_FORMS.update({"gather-elements-lines": _gather_elements_lines, "scatter-nd-rows": _scatter_nd_rows,
                    "scatter-nd-pairs": _scatter_nd_pairs})
CASE_IDS.update({name: f"case{len(CASES) + index}" for index, name in enumerate(OTHER_FORMS)})
with tempfile.TemporaryDirectory() as _folder:
    for _merged in MERGED.values():
        for _name, (_rows, _width, _ids, _nd) in CASES.items():
            _merged.add(CASE_IDS[_name], onnx.load(_case_path(_folder, _name)), {"ids": _ids.astype(np.int64)})
        for _name, _write in OTHER_FORMS.items():
            _feeds = _write(os.path.join(_folder, f"{_name}.onnx"))
            _merged.add(CASE_IDS[_name], onnx.load(os.path.join(_folder, f"{_name}.onnx")), _feeds)
