"""The command line: the happy path, dumps for Netron, and every bad input as a one-line error."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fblc.cli import main
from fblc.compiler.reference import ReferenceStep
from tests.conftest import make_model, mlp_proto


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_train_graph_writes_a_step_onnxruntime_trains_with(tmp_path, mlp_path, capsys) -> None:
    out = str(tmp_path / "step.onnx")
    code, stdout, _ = run_cli(capsys, "train-graph", mlp_path, "-o", out, "--optimizer", "adamw", "--lr", "0.05")
    assert code == 0
    assert "trainable: 4 tensors, 83 parameters" in stdout
    trainer = ReferenceStep(out)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((4, 6)).astype(np.float32), "labels": np.array([0, 1, 2, 1])}
    losses = [trainer.step(batch) for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0]


def test_dump_dir_has_one_valid_model_per_pass(tmp_path, mlp_path, capsys) -> None:
    dumps = tmp_path / "dumps"
    code, _, _ = run_cli(capsys, "train-graph", mlp_path, "-o", str(tmp_path / "s.onnx"), "--dump-dir", str(dumps))
    assert code == 0
    names = sorted(os.listdir(dumps))
    assert names[0] == "00_fix_input_shapes.onnx" and names[-1].endswith("_optimizer_step.onnx")
    assert [n.split("_", 1)[0] for n in names] == [f"{i:02d}" for i in range(len(names))]
    for name in names:
        onnx.checker.check_model(str(dumps / name), full_check=True)
    last = onnx.load(str(dumps / names[-1]))
    stages = {p.key: p.value for n in last.graph.node for p in n.metadata_props}
    assert stages.get("fblc.stage") in {"backward", "optimizer", "loss"}


def unsupported_op_model(path: str) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Cosh", ["h"], ["y"], name="odd_activation")]
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                         {"w": np.ones((3, 4), np.float32)}), path)


def dynamic_model(path: str) -> None:
    onnx.save(mlp_proto(batch="batch"), path)


def frozen_only_model(path: str) -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], {}), path)


def not_onnx(path: str) -> None:
    with open(path, "w") as handle:
        handle.write("name,value\nlr,0.1\n")


def truncated(path: str) -> None:
    data = mlp_proto().SerializeToString()
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])


@pytest.mark.parametrize("make, extra, message", [
    (not_onnx, [], "is not a readable ONNX model"),
    (truncated, [], "is not a readable ONNX model"),
    (unsupported_op_model, ["--loss", "mse"], "no gradient rule for op Cosh (node 'odd_activation')"),
    (dynamic_model, [], "model input 'x' has dynamic dims [?x6]; pass --input-shape x=DIMS"),
    (frozen_only_model, ["--loss", "mse"], "nothing to train"),
    (lambda p: onnx.save(mlp_proto(), p), ["--train", "^conv"], "--train '^conv' matches no parameter"),
    (lambda p: None, [], "no such file"),
], ids=["not-onnx", "truncated", "unsupported-op", "dynamic-dim", "nothing-to-train", "train-matches-nothing",
        "missing-file"])
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, capsys, make, extra, message) -> None:
    model = str(tmp_path / "model.onnx")
    make(model)
    out = tmp_path / "step.onnx"
    code, stdout, stderr = run_cli(capsys, "train-graph", model, "-o", str(out), *extra)
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("fblc: error: ")
    assert message in stderr
    assert "Traceback" not in stderr
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == (["model.onnx"] if os.path.exists(model) else [])


def test_unsupported_op_lists_the_supported_ones(tmp_path, capsys) -> None:
    model = str(tmp_path / "model.onnx")
    unsupported_op_model(model)
    _, _, stderr = run_cli(capsys, "train-graph", model, "-o", str(tmp_path / "s.onnx"), "--loss", "mse")
    supported = stderr.split("supported:")[-1]
    assert all(op in supported for op in ("Conv", "Cos", "Div", "MatMul")), stderr


def test_debug_shows_the_traceback_and_plain_run_does_not(tmp_path) -> None:
    model = str(tmp_path / "bad.onnx")
    not_onnx(model)
    command = [sys.executable, "-m", "fblc.cli", "train-graph", model, "-o", str(tmp_path / "s.onnx")]
    plain = subprocess.run(command, capture_output=True, text=True)
    debug = subprocess.run(command + ["--debug"], capture_output=True, text=True)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_bad_flag_values_are_usage_errors(tmp_path, mlp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train-graph", mlp_path, "-o", str(tmp_path / "s.onnx"), "--input-shape", "x=4xfour"])
    assert exit_info.value.code == 2
    assert "is not NAME=DIMS" in capsys.readouterr().err


def test_help_lists_the_commands_and_options(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train-graph", "--help"])
    text = capsys.readouterr().out
    for option in ("--input-shape", "--loss", "--optimizer", "--train", "--freeze", "--bn-train", "--dump-dir"):
        assert option in text


def test_compile_with_the_traced_layout_search_says_so_and_reports_it(tmp_path, mlp_path, capsys) -> None:
    """`--layout-search traced` traces the step's kernels first (said on stderr) and `--report` names the search."""
    import json

    out = str(tmp_path / "bundle")
    code, stdout, stderr = run_cli(capsys, "compile", mlp_path, "--target", "adreno830", "-o", out,
                                   "--layout-search", "traced", "--report", "--weights", "int4")
    assert code == 0, stderr
    assert "tracing the reads of the step's kernels" in stderr
    # every weight of the MLP trains: int4 has nothing to store, and says so in one line
    assert [line for line in stderr.splitlines() if "--weights int4 changed nothing" in line]
    assert "layout rtile (search traced)" in stdout
    with open(os.path.join(out, "report.json"), encoding="utf-8") as handle:
        report = json.load(handle)
    assert report["layout"]["search"] == "traced" and report["weights"]["quantized"] == []
    # the stages' seconds, the disk write of params.bin apart; its checksum, hashed as it was written, holds
    assert list(report["timings"]) == ["read_model", "passes", "codegen", "buffer_table", "reports", "write_params",
                                      "write_params_cpu"]
    assert all(seconds >= 0 for seconds in report["timings"].values())
    from fblc.bundle_format import load_verified
    load_verified(out)
