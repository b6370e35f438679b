"""Every gap in one message (import, gradient rules, kernel emitters) and `fblc check`.

The unsupported ops are hyperbolic and inverse trigonometric functions on purpose: the ops the
issues name (Einsum, TopK, Softplus...) are being added, and this test must keep failing models
failing.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.cli import main
from fblc.compiler.gaps import NODES_SHOWN, describe_gaps, group_by_op
from tests.conftest import make_model, mlp_proto

#: op -> its nodes, on the path from the trainable w to the loss
ON_PATH = {"Cosh": ["cosh_1", "cosh_2"], "Tan": ["tan"], "Asinh": ["asinh"]}


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def several_gaps_model(path: str) -> str:
    """x -> Sinh (frozen front: needs a kernel, no gradient) -> MatMul(w) -> Cosh -> Cosh -> Tan -> Asinh -> y."""
    nodes = [helper.make_node("Sinh", ["x"], ["x2"], name="front"),
             helper.make_node("MatMul", ["x2", "w"], ["h"], name="proj"),
             helper.make_node("Cosh", ["h"], ["c1"], name="cosh_1"),
             helper.make_node("Cosh", ["c1"], ["c2"], name="cosh_2"),
             helper.make_node("Tan", ["c2"], ["a"], name="tan"),
             helper.make_node("Asinh", ["a"], ["y"], name="asinh")]
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                         {"w": np.full((3, 4), 0.1, np.float32)}), path)
    return path


def frozen_front_model(path: str) -> str:
    """The MLP behind Sinh, Sinh, Tan on its input: no gradient needs them, every kernel does."""
    model = mlp_proto()
    model.graph.node[0].input[0] = "x3"
    front = [helper.make_node("Sinh", ["x"], ["x1"], name="sinh_1"),
             helper.make_node("Sinh", ["x1"], ["x2"], name="sinh_2"),
             helper.make_node("Tan", ["x2"], ["x3"], name="tan")]
    for node in reversed(front):
        model.graph.node.insert(0, node)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _assert_one_line_naming(stderr: str, ops: dict[str, list[str]], what: str) -> None:
    assert stderr.count("\n") == 1 and stderr.startswith("fblc: error: "), stderr
    assert f"{len(ops)} ops have no {what}: " in stderr
    for op, names in ops.items():
        listed = ", ".join(f"'{n}'" for n in names)
        assert f"{op} ({len(names)} node{'s' if len(names) > 1 else ''}: {listed})" in stderr, (op, stderr)
    assert "Traceback" not in stderr


@pytest.mark.parametrize("command", ["train-graph", "compile"])
def test_every_op_without_a_gradient_rule_is_in_one_error(tmp_path, capsys, command) -> None:
    model = several_gaps_model(str(tmp_path / "model.onnx"))
    out = str(tmp_path / "out")
    code, stdout, stderr = run_cli(capsys, command, model, "-o", out, "--loss", "mse")
    assert code == 2 and stdout == ""
    _assert_one_line_naming(stderr, ON_PATH, "gradient rule")
    assert "Sinh" not in stderr.split("; supported ops")[0]  # frozen: it needs no gradient
    assert not os.path.exists(out)


def test_every_op_without_a_kernel_is_in_one_error(tmp_path, capsys) -> None:
    model = frozen_front_model(str(tmp_path / "model.onnx"))
    code, _, stderr = run_cli(capsys, "compile", model, "-o", str(tmp_path / "bundle"))
    assert code == 2
    _assert_one_line_naming(stderr, {"Sinh": ["sinh_1", "sinh_2"], "Tan": ["tan"]}, "OpenCL kernel emitter")
    assert "supported ops: Abs, Add" in stderr


def test_a_missing_rule_and_a_refused_node_are_one_error(tmp_path, capsys) -> None:
    """A rule that refuses a node (training-mode Dropout) is reported beside the ops without a rule."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Dropout", ["h", "ratio", "training"], ["d"], name="drop_train"),
             helper.make_node("Cosh", ["d"], ["y"], name="cosh")]
    model = str(tmp_path / "model.onnx")
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                         {"w": np.ones((3, 4), np.float32), "ratio": np.array(0.5, np.float32),
                          "training": np.array(True)}), model)
    code, _, stderr = run_cli(capsys, "train-graph", model, "-o", str(tmp_path / "s.onnx"), "--loss", "mse",
                              "--freeze", "ratio")
    assert code == 2 and stderr.count("\n") == 1
    assert "no gradient rule for op Cosh (node 'cosh')" in stderr and "drop_train" in stderr
    code, stdout, _ = run_cli(capsys, "check", model, "--loss", "mse", "--freeze", "ratio")
    assert code == 1
    assert _row(stdout, "Dropout").split()[3] == "refused" and _row(stdout, "Cosh").split()[3] == "missing"


def test_import_names_every_op_without_shape_inference_and_every_data_dependent_node(tmp_path, capsys) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("FusedGelu", ["h"], ["g"], domain="com.microsoft", name="gelu_1"),
             helper.make_node("FusedGelu", ["g"], ["g2"], domain="com.microsoft", name="gelu_2"),
             helper.make_node("Relu", ["g2"], ["r"], name="relu_after"),  # unknown only because of its input
             helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
             helper.make_node("Cast", ["nz"], ["nzf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("ReduceSum", ["nzf"], ["s"], keepdims=0, name="sum"),
             # a Range counting NonZero's hits has static inputs but inherits the unknown size: named, not blamed
             helper.make_node("Shape", ["nz"], ["count"], start=1, name="count"),
             helper.make_node("ReduceMax", ["count"], ["n"], keepdims=0, name="n"),
             helper.make_node("Range", ["zero", "n", "one"], ["hits"], name="range"),
             helper.make_node("Cast", ["hits"], ["hitsf"], to=TensorProto.FLOAT, name="cast_hits"),
             helper.make_node("ReduceSum", ["hitsf"], ["t"], keepdims=0, name="sum_hits"),
             helper.make_node("Add", ["r", "s"], ["rs"], name="add"),
             helper.make_node("Add", ["rs", "t"], ["y"], name="add_hits")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              initializer=[numpy_helper.from_array(np.ones((3, 4), np.float32), "w"),
                                           numpy_helper.from_array(np.array(0, np.int64), "zero"),
                                           numpy_helper.from_array(np.array(1, np.int64), "one")])
    model = str(tmp_path / "model.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                      helper.make_opsetid("com.microsoft", 1)]), model)
    code, _, stderr = run_cli(capsys, "train-graph", model, "-o", str(tmp_path / "s.onnx"), "--loss", "mse")
    assert code == 2 and stderr.count("\n") == 1
    assert "no shape rule at import for op com.microsoft.FusedGelu (2 nodes: 'gelu_1', 'gelu_2')" in stderr
    assert "2 nodes have shapes that depend on data: NonZero (1 node: 'nonzero'), Range (1 node: 'range')" in stderr
    assert "node 'nonzero' sizes its output by the values of 'x'" in stderr
    assert "as constants" in stderr
    for downstream in ("relu_after", "cast", "'sum'", "'add'", "sum_hits"):
        assert downstream not in stderr
    code, stdout, _ = run_cli(capsys, "check", model, "--loss", "mse")
    assert code == 1
    assert "no shape rule" in _row(stdout, "com.microsoft.FusedGelu") and "data-dependent" in _row(stdout, "NonZero")


def test_long_node_lists_are_cut_but_every_op_is_named() -> None:
    nodes = [ir.Node("", "Cosh", [], name=f"c{i}") for i in range(NODES_SHOWN + 2)] + [ir.Node("", "Tan", [], name="a")]
    message = describe_gaps("gradient rule", group_by_op(nodes))
    assert message == f"2 ops have no gradient rule: Cosh ({NODES_SHOWN + 2} nodes: 'c0', 'c1', 'c2' and 2 more), " \
                      "Tan (1 node: 'a')"


def _row(stdout: str, op: str) -> str:
    return next(line for line in stdout.splitlines() if line.split() and line.split()[0] == op)


def test_check_of_a_supported_model_prints_every_op_and_exits_0(tmp_path, mlp_path, capsys) -> None:
    code, stdout, stderr = run_cli(capsys, "check", mlp_path)
    assert code == 0, stdout + stderr
    for op, layout in (("Gemm", "FTD-D"), ("Relu", "FTD-C"), ("MatMul", "FTD-D"), ("Add", "FTI-C")):
        assert _row(stdout, op).split() == [op, "1", "ok", "yes", "yes", layout]
    assert "Identity" not in stdout  # removed at import: the table is of the imported model
    assert "train (graph mode): yes - 4 trainable tensors, 83 parameters" in stdout
    assert "run on the device: yes" in stdout
    assert "memflora: no - no Conv with groups == 1" in stdout
    assert sorted(os.listdir(tmp_path)) == ["mlp.onnx"]  # check writes nothing


def test_check_of_an_unsupported_model_names_each_missing_op_and_exits_1(tmp_path, capsys) -> None:
    model = several_gaps_model(str(tmp_path / "model.onnx"))
    code, stdout, _ = run_cli(capsys, "check", model, "--loss", "mse")
    assert code == 1
    for op, names in ON_PATH.items():
        assert _row(stdout, op).split()[:5] == [op, str(len(names)), "ok", "missing", "missing"]
    assert _row(stdout, "Sinh").split()[:6] == ["Sinh", "1", "ok", "not", "needed", "missing"]
    trains = next(line for line in stdout.splitlines() if line.startswith("train (graph mode)"))
    assert trains.startswith("train (graph mode): no - 3 ops have no gradient rule: Cosh (2 nodes")
    runs = next(line for line in stdout.splitlines() if line.startswith("run on the device"))
    assert runs.startswith("run on the device: no") and all(op in runs for op in ["Sinh", *ON_PATH])


def test_check_finds_kernel_gaps_of_a_model_that_trains(tmp_path, capsys) -> None:
    model = frozen_front_model(str(tmp_path / "model.onnx"))
    code, stdout, _ = run_cli(capsys, "check", model)
    assert code == 1
    assert "train (graph mode): yes" in stdout
    assert "run on the device: no - 2 ops have no OpenCL kernel emitter: Sinh (2 nodes: 'sinh_1', 'sinh_2'), " \
           "Tan (1 node: 'tan')" in stdout


def test_check_says_which_adapters_apply_to_a_cnn(tmp_path, capsys) -> None:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["logits"], name="flat")]
    model = str(tmp_path / "cnn.onnx")
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 5])],
                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 4])],
                         {"conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                          "conv.bias": np.zeros(4, np.float32)}), model)
    code, stdout, _ = run_cli(capsys, "check", model)
    assert code == 0
    assert "adapters: lora, memflora, memflora-sg" in stdout and "memflora: yes - 1 conv site" in stdout
    code, stdout, _ = run_cli(capsys, "check", model, "--adapter", "memflora")
    assert code == 0 and _row(stdout, "Relu").split()[3:5] == ["not", "needed"]  # mask form: Where's rule


def test_check_of_bad_input_is_one_line_exit_2(tmp_path, capsys) -> None:
    model = str(tmp_path / "dynamic.onnx")
    onnx.save(mlp_proto(batch="batch"), model)
    code, stdout, stderr = run_cli(capsys, "check", model)
    assert code == 2 and stdout == "" and stderr.count("\n") == 1
    assert "pass --input-shape x=DIMS" in stderr
    code, stdout, _ = run_cli(capsys, "check", model, "--input-shape", "x=2x6")
    assert code == 0
