"""Training data that would train wrongly is refused before any work: ids past the table they index,
arrays of different row counts, labels that are all the ignore index (issue 36)."""

from __future__ import annotations

import json
import os
import types
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from fblc import bundle_format as fmt
from fblc.cli import main
from fblc.cli.data import batches
from fblc.cli.outputs import print_step
from fblc.compiler import keys
from fblc.compiler.model_io import load_model
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes
from fblc.runtime.feeds import index_problem
from fblc.runtime.local import DataError, LocalRunner
from tests.conftest import make_model
from tests.support.bundles import compiled
from tests.support import zoo
from tests.test_bad_values import no_runner, refused  # noqa: F401 (no_runner: a fixture)

VOCAB, WIDTH, CLASSES, BATCH, LENGTH = 50, 8, 3, 4, 5


def embedding_proto() -> onnx.ModelProto:
    """input_ids [4, 5] -> Gather('embed.weight' [50, 8]) -> mean over the tokens -> Gemm: logits [4, 3]."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["embed.weight", "input_ids"], ["tokens"], name="/embed/Gather"),
             helper.make_node("ReduceMean", ["tokens", "axes"], ["mean"], keepdims=0, name="mean"),
             helper.make_node("Gemm", ["mean", "head.weight", "head.bias"], ["logits"], transB=1, name="head")]
    inits = {"embed.weight": rng.standard_normal((VOCAB, WIDTH)).astype(np.float32), "axes": np.array([1]),
             "head.weight": rng.standard_normal((CLASSES, WIDTH)).astype(np.float32),
             "head.bias": rng.standard_normal(CLASSES).astype(np.float32)}
    return make_model(nodes, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [BATCH, LENGTH])],
                      [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, CLASSES])], inits)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> str:
    return compiled(str(tmp_path_factory.mktemp("bundle")), embedding_proto(), "embedding")


def manifest_of(bundle: str) -> dict:
    return json.load(open(os.path.join(bundle, fmt.MANIFEST)))


def token_data(rows: int = 8, **arrays: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    data = {"input_ids": rng.integers(0, VOCAB, (rows, LENGTH)), "labels": rng.integers(0, CLASSES, rows)}
    return {**data, **arrays}


def saved(folder: str, **arrays: np.ndarray) -> str:
    path = os.path.join(folder, "data.npz")
    np.savez(path, **arrays)
    return path


def with_id(value: int, at: tuple[int, int]) -> np.ndarray:
    ids = token_data()["input_ids"]
    ids[at] = value
    return ids


# --- ids past the table -------------------------------------------------------------------------------------
TABLE = "the table 'embed.weight' of 50 rows that node '/embed/Gather' indexes; give ids in [0, 50) (or -50 to -1, " \
        "counting from the end)"


@pytest.mark.parametrize("value, at, side", [(500, (0, 3), "past"), (VOCAB, (7, 4), "past"),
                                             (-VOCAB - 1, (1, 2), "before the start of")])
def test_an_id_outside_the_table_is_refused_before_the_runner_is_built(tmp_path, bundle, capsys, no_runner, value,
                                                                       at, side) -> None:
    data = saved(str(tmp_path), **token_data(input_ids=with_id(value, at)))
    expected = f"data file '{data}': array 'input_ids' has {value} at index {list(at)}: {side} {TABLE}"
    for device in ("local", "adb:127.0.0.1:1"):  # the phone's batches are checked before adb is looked for
        assert refused(capsys, str(tmp_path), "run", bundle, "--data", data, "--device", device) == expected


def test_negative_ids_count_from_the_end_as_the_kernels_compute_them(tmp_path, bundle) -> None:
    ids = with_id(-VOCAB, (0, 0))
    ids[1] = [-1, VOCAB - 1, 0, -25, 7]
    cut, _ = batches(saved(str(tmp_path), **token_data(input_ids=ids)), manifest_of(bundle))
    assert cut[0]["input_ids"][0, 0] == -VOCAB


def test_the_local_runner_refuses_an_id_past_the_table(bundle) -> None:
    runner = types.SimpleNamespace(manifest=manifest_of(bundle))  # check_feeds reads only the manifest
    feeds = {name: array[:BATCH] for name, array in token_data(input_ids=with_id(500, (2, 1))).items()}
    with pytest.raises(DataError) as refusal:
        LocalRunner.check_feeds(runner, feeds)  # type: ignore[arg-type]
    assert str(refusal.value) == f"array 'input_ids' has 500 at index [2, 1]: past {TABLE}"
    feeds["input_ids"] = feeds["input_ids"].astype(np.float32)  # not cast by the caller: checked all the same
    with pytest.raises(DataError, match=r"has 500 at index \[2, 1\]: past the table"):
        LocalRunner.check_feeds(runner, feeds)  # type: ignore[arg-type]


def _tables_proto() -> onnx.ModelProto:
    """ids reach four tables: directly, through Cast/Reshape/Concat/Slice (10 rows: the tightest), through
    arithmetic (not followed) and a OneHot (no table); pairs are GatherND tuples, cols GatherElements indices."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Gather", ["big", "ids"], ["g1"], name="big_gather"),
             helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
             helper.make_node("Reshape", ["ids32", "flat"], ["ids_flat"]),
             helper.make_node("Concat", ["ids_flat", "extra"], ["joined"], axis=0),
             helper.make_node("Slice", ["joined", "starts", "ends"], ["some"]),
             helper.make_node("Gather", ["small", "some"], ["g2"], name="small_gather"),
             helper.make_node("Add", ["ids", "one"], ["shifted"]),
             helper.make_node("Gather", ["tiny", "shifted"], ["g3"], name="shifted_gather"),
             helper.make_node("OneHot", ["ids", "depth", "off_on"], ["hot"], name="one_hot"),
             helper.make_node("GatherND", ["cube", "pairs"], ["g4"], name="pairs_gather"),
             helper.make_node("GatherElements", ["wide", "cols"], ["g5"], axis=-1, name="cols_gather")]
    inits = {"big": np.zeros((50, 4), np.float32), "small": np.zeros((10, 4), np.float32),
             "tiny": np.zeros((3, 4), np.float32), "flat": np.array([6]), "extra": np.array([1, 2], np.int32),
             "starts": np.array([1]), "ends": np.array([7]), "one": np.array(1), "depth": np.array(2),
             "off_on": np.array([0, 1], np.float32), "cube": np.zeros((7, 5, 4), np.float32),
             "wide": np.zeros((2, 9), np.float32)}
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
              helper.make_tensor_value_info("pairs", TensorProto.INT64, [2, 2]),
              helper.make_tensor_value_info("cols", TensorProto.INT64, [2, 3]),
              helper.make_tensor_value_info("hot_only", TensorProto.INT64, [2])]
    nodes.append(helper.make_node("OneHot", ["hot_only", "depth", "off_on"], ["hot2"]))
    shapes = {"g1": [2, 3, 4], "g2": [6, 4], "g3": [2, 3, 4], "hot": [2, 3, 2], "g4": [2, 4], "g5": [2, 3],
              "hot2": [2, 2]}
    outputs = [helper.make_tensor_value_info(name, f, shape) for name, shape in shapes.items()]
    return make_model(nodes, inputs, outputs, inits)


def test_index_ranges_follow_value_keeping_ops_to_the_tightest_table() -> None:
    model = run_passes(ir.from_proto(_tables_proto()), import_passes(TrainingOptions()))
    recorded = {v.name: json.loads(v.metadata_props[keys.INDEX_TABLE]) for v in model.graph.inputs
                if keys.INDEX_TABLE in v.metadata_props}
    assert recorded == {"ids": [{"size": 10, "axis": 0, "table": "small", "node": "small_gather"}],
                        "pairs": [{"size": 7, "axis": 0, "table": "cube", "node": "pairs_gather", "position": 0},
                                  {"size": 5, "axis": 1, "table": "cube", "node": "pairs_gather", "position": 1}],
                        "cols": [{"size": 9, "axis": 1, "table": "wide", "node": "cols_gather"}]}


def test_index_tuples_are_bounded_entry_by_entry_and_loosely_once_reshaped() -> None:
    """GatherND over a [7, 5, 4] cube: a pair's entry 0 indexes 7 rows, entry 1 five columns (-6 and 6 are fine
    in entry 0); pairs that reach the tuples through a Reshape are bounded by the widest axis alone."""
    cube = {"cube": np.zeros((7, 5, 4), np.float32), "shape": np.array([2, 2])}
    nodes = [helper.make_node("GatherND", ["cube", "pairs"], ["direct"], name="direct_gather"),
             helper.make_node("Reshape", ["flat", "shape"], ["pairs2"]),
             helper.make_node("GatherND", ["cube", "pairs2"], ["reshaped"], name="reshaped_gather")]
    inputs = [helper.make_tensor_value_info("pairs", TensorProto.INT64, [2, 2]),
              helper.make_tensor_value_info("flat", TensorProto.INT64, [4])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4]) for name in ("direct", "reshaped")]
    model = run_passes(ir.from_proto(make_model(nodes, inputs, outputs, cube)), import_passes(TrainingOptions()))
    entries = {v.name: {"name": v.name, "indexes": json.loads(v.metadata_props[keys.INDEX_TABLE])}
               for v in model.graph.inputs}
    assert [bound["size"] for bound in entries["pairs"]["indexes"]] == [7, 5]
    assert entries["flat"]["indexes"] == [{"size": 7, "axis": 0, "table": "cube", "node": "reshaped_gather"}]
    assert index_problem(entries["pairs"], np.array([[6, 4], [-7, -5]])) is None
    assert index_problem(entries["pairs"], np.array([[-6, 0], [6, 5]])) == (
        "array 'pairs' has 5 at index [1, 1]: past the table 'cube' of 5 entries along axis 1 that node "
        "'direct_gather' indexes with entry 1 of each index tuple; give ids in [0, 5) (or -5 to -1, counting from "
        "the end)")
    assert index_problem(entries["flat"], np.array([6, 6, -7, 0])) is None


class TinyTokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(1))


@pytest.mark.parametrize("dynamo, node", [(True, "node_embedding"), (False, "/embed/Gather")], ids=["dynamo", "legacy"])
def test_an_exported_embedding_records_its_table(tmp_path, dynamo, node) -> None:
    model, ids = str(tmp_path / "model.onnx"), torch.zeros((BATCH, LENGTH), dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(TinyTokenModel(), (ids,), dynamo=True, optimize=False, verbose=False).save(model)
        else:
            torch.onnx.export(TinyTokenModel(), (ids,), model, dynamo=False, input_names=["input_ids"])
    out = str(tmp_path / "bundle")
    assert main(["compile", model, "-o", out, "-q"]) == 0
    manifest = manifest_of(out)
    assert manifest["inputs"][0]["indexes"] == [{"size": VOCAB, "axis": 0, "table": "embed.weight", "node": node}]
    data = saved(str(tmp_path), **token_data(input_ids=with_id(500, (0, 3))))
    with pytest.raises(DataError, match=rf"has 500 at index \[0, 3\]: past the table 'embed.weight' of 50 rows that "
                                        rf"node '{node}' indexes"):
        batches(data, manifest)


def test_a_transformers_model_records_its_vocabulary(tmp_path) -> None:
    exported = zoo.build(zoo.BY_NAME["roberta"], str(tmp_path))  # legacy export; the passes only, no kernels
    model = run_passes(load_model(exported.path), import_passes(TrainingOptions()))
    ids = next(v for v in model.graph.inputs if v.name == "input_ids")
    assert json.loads(ids.metadata_props[keys.INDEX_TABLE]) == [{
        "size": zoo.VOCAB, "axis": 0, "table": "roberta.embeddings.word_embeddings.weight",
        "node": "/roberta/embeddings/word_embeddings/Gather"}]


# --- row counts ---------------------------------------------------------------------------------------------
def test_arrays_of_different_row_counts_are_refused(tmp_path, bundle, capsys, no_runner) -> None:
    data = saved(str(tmp_path), **token_data(rows=16, labels=np.zeros(8, np.int64)))
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data) == (
        f"data file '{data}': its arrays have different row counts ('input_ids' 16, 'labels' 8); each row is one "
        "example, so give every array the same number of rows")


# --- labels that all are the ignore index -------------------------------------------------------------------
def test_a_file_whose_labels_are_all_ignored_is_refused(tmp_path, bundle, capsys, no_runner) -> None:
    data = saved(str(tmp_path), **token_data(labels=np.full(8, -100)))
    assert refused(capsys, str(tmp_path), "run", bundle, "--data", data) == (
        f"data file '{data}': every label in 'labels' is the ignore index -100, in all 8 rows, so no position counts "
        "in the loss and training would learn nothing; give labels in [0, 3) where the loss should count")
    only_left_over = np.full(10, -100)
    only_left_over[9] = 1  # in the rows past the last full batch, which are not used
    data = saved(str(tmp_path), **token_data(rows=10, labels=only_left_over))
    assert "is the ignore index -100, in the 8 rows that fill whole batches, so no position counts" in refused(
        capsys, str(tmp_path), "run", bundle, "--data", data, "--device", "adb:127.0.0.1:1")


def test_batches_whose_labels_are_all_ignored_get_one_note(tmp_path, bundle) -> None:
    labels = np.zeros(14, np.int64)
    labels[4:8] = -100
    cut, note = batches(saved(str(tmp_path), **token_data(rows=14, labels=labels)), manifest_of(bundle))
    assert len(cut) == 3 and note == ("2 rows past the last full batch are not used; 1 of 3 batches has only ignored "
                                      "labels (every 'labels' value -100): batch 2; its step adds no gradient")
    labels[:4] = -100
    _, note = batches(saved(str(tmp_path), **token_data(rows=12, labels=labels[:12])), manifest_of(bundle))
    assert note == "2 of 3 batches have only ignored labels (every 'labels' value -100): batches 1, 2; their steps " \
                   "add no gradient"


def test_a_loss_of_minus_zero_prints_as_zero(capsys) -> None:
    print_step(1, -0.0, {}, 1.0, as_json=False)
    print_step(2, -0.0, {}, 1.0, as_json=True)
    lines = capsys.readouterr().out.splitlines()
    assert "loss 0.000000 " in lines[0] and json.loads(lines[1])["loss"] == 0.0 and '"loss": 0.0' in lines[1]
