"""Kernels of fblc/codegen/kernels/activations.py, one training step on PoCL against onnxruntime:
LeakyRelu, PRelu, Elu, Selu, Celu, ThresholdedRelu, Softplus, Mish, Softsign, Gelu (opset 20),
Floor and Sign, and the backward kernels of their gradient rules and of Abs, Max, Min and Sum.

Each model is the op on trainable initializers, then ReduceSum(y * R) (tests/test_kernels_other.py's
harness), so the forward kernel and the kernels of its backward all run. Shapes pick the code
paths: an innermost axis a multiple of 4 (whole-texel reads) or not (per-lane ones); a fused case
puts the activation in a contraction's epilogue (evaluate_chain).

The unary, large-input, rounding and variadic cases run as one merged step (tests/support/merged_steps.py:
one PoCL build instead of 49, each case still judged on its own parameters' rows); each case's inputs are
drawn with their own seed, since tie_weights would make equal initializers of two cases one parameter.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.passes.pipeline import TrainingOptions
from fblc.tools.verify import verify_model
from tests.conftest import make_model
from tests.support import merged_steps
from tests.test_kernels_other import SGD, _check, _op_then_loss, _randn

SHAPES = [[2, 3, 8], [3, 5]]

#: (op, attributes) of the unary activations; x is normal of scale 2.5, so every piece is hit
UNARY = [
    ("LeakyRelu", {}), ("LeakyRelu", {"alpha": 0.2}), ("Elu", {}), ("Elu", {"alpha": 0.7}), ("Selu", {}),
    ("Selu", {"alpha": 1.3, "gamma": 0.8}), ("Celu", {}), ("Celu", {"alpha": 0.5}), ("ThresholdedRelu", {}),
    ("ThresholdedRelu", {"alpha": 0.5}), ("Softplus", {}), ("Mish", {}), ("Softsign", {}),
    ("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Abs", {}),
]


def _gelu_model(op: onnx.NodeProto, y_shape: list[int], inits: dict[str, np.ndarray],
                extra: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """`_op_then_loss` at opset 20, where Gelu exists (fblc keeps opsets from 18 on as they are)."""
    r = numpy_helper.from_array(np.random.default_rng(1).standard_normal(y_shape).astype(np.float32), "R")
    nodes = (extra or []) + [op, helper.make_node("Constant", [], ["R"], value=r, name="r"),
                             helper.make_node("Mul", ["y", "R"], ["yr"], name="mul"),
                             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0, name="sum")]
    return make_model(nodes, [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits, opset=20)


def _model(op: onnx.NodeProto, y_shape: list[int], inits: dict[str, np.ndarray],
           extra: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    build = _gelu_model if op.op_type == "Gelu" else _op_then_loss
    return build(op, y_shape, inits, extra=extra)


def _assert_fused(tmp_path, model: onnx.ModelProto, contraction: str, activation: str) -> None:
    """The activation node runs in the contraction's kernel (its epilogue), not a kernel of its own."""
    from fblc.codegen.compile import compile_model
    from fblc.compiler import keys

    path = str(tmp_path / "fused.onnx")
    onnx.save(model, path)
    step, _ = compile_model(path, str(tmp_path / "fused.bundle"), "local", "fp32",
                            TrainingOptions(loss="output", optimizer=SGD))
    kernels = {n.name: n.metadata_props.get(keys.KERNEL) for n in step.graph if n.name in (contraction, activation)}
    assert kernels[activation] is not None and kernels[activation] == kernels[contraction], kernels


def _ids(value: object) -> str:
    if isinstance(value, dict):
        return "-".join(f"{k}{v}" for k, v in value.items()) or "defaults"
    return str(value)


def _unary_case(index: int, op_type: str, attributes: dict[str, object], shape: list[int]) -> onnx.ModelProto:
    x = _randn(*shape, seed=index, scale=2.5)
    return _model(helper.make_node(op_type, ["x"], ["y"], name="act", **attributes), shape, {"x": x})


def _large_inputs_case(index: int, op_type: str) -> onnx.ModelProto:
    """x = +-100 and +-30 (scaled by 1 + index / 64: each case its own parameter)."""
    x = np.array([[-100.0, 100.0, -30.0, 30.0, -20.5, 20.5, 0.5]], np.float32) * np.float32(1 + index / 64)
    return _model(helper.make_node(op_type, ["x"], ["y"], name="act"), [1, 7], {"x": x})


def _rounding_case(index: int, ops: list[str]) -> onnx.ModelProto:
    shape = [3, 6]
    names = ["x"] + [f"f{i}" for i in range(len(ops))]
    extra = [helper.make_node(op, [a], [b], name=f"op{i}") for i, (op, a, b) in enumerate(zip(ops, names, names[1:]))]
    op = helper.make_node("Mul", ["w", names[-1]], ["y"], name="mul_w")
    return _op_then_loss(op, shape, {"w": _randn(*shape, seed=index)}, extra=extra,
                         inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)])


def _variadic_case(index: int, op_type: str, shapes: tuple[list[int], ...]) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(len(shapes))]
    inits = {n: _randn(*s, seed=10 * index + i) for i, (n, s) in enumerate(zip(names, shapes))}
    first, second = inits[names[0]], inits[names[1]]
    first[..., 0] = np.broadcast_to(second, first.shape)[..., 0]  # ties: half of dy each
    op = helper.make_node(op_type, names, ["y"], name="variadic")
    out_shape = list(np.broadcast_shapes(*map(tuple, shapes)))
    return _op_then_loss(op, out_shape, inits)


UNARY_CASES = [(op, attributes, shape) for op, attributes in UNARY for shape in SHAPES]
LARGE_INPUT_OPS = ["Softplus", "Mish", "Softsign", "Gelu", "Elu", "Selu", "Celu"]
ROUNDING = [["Floor"], ["Floor", "Sign"], ["Ceil"], ["Round"]]
VARIADIC = [(op, shapes) for shapes in [([2, 3, 8], [3, 8]), ([3, 5], [3, 1], [5])] for op in ["Max", "Min", "Sum"]]
#: case id (a prefix of its values' names in the merged step) -> its model
MERGED_CASES = {**{f"unary{i}": _unary_case(i, *case) for i, case in enumerate(UNARY_CASES)},
                **{f"large{i}": _large_inputs_case(i, op) for i, op in enumerate(LARGE_INPUT_OPS)},
                **{f"rounding{i}": _rounding_case(i, ops) for i, ops in enumerate(ROUNDING)},
                **{f"variadic{i}": _variadic_case(i, *case) for i, case in enumerate(VARIADIC)}}
MERGED = pytest.mark.xdist_group("activations-merged")  # one worker builds the merged step for all its tests


@pytest.fixture(scope="module")
def merged_rows(tmp_path_factory) -> list:
    """One SGD step of all MERGED_CASES on PoCL against onnxruntime."""
    folder = str(tmp_path_factory.mktemp("activations_merged"))
    return merged_steps.verify_merged(MERGED_CASES, TrainingOptions(loss="output", optimizer=SGD), folder)


def _check_case(rows: list, case: str) -> None:
    merged_steps.assert_case_matches(rows, case, list(MERGED_CASES))


@MERGED
@pytest.mark.parametrize("index", range(len(UNARY_CASES)),
                         ids=[f"{op}-{_ids(attributes)}-{shape}" for op, attributes, shape in UNARY_CASES])
def test_unary_activation(merged_rows: list, index: int) -> None:
    _check_case(merged_rows, f"unary{index}")


def test_atan(tmp_path) -> None:
    """The op docs/ARCHITECTURE.md's recipe added (a table row, a gradient, an expression): one step
    against onnxruntime, on a shape whose innermost axis is not a multiple of 4 (per-lane reads)."""
    op = helper.make_node("Atan", ["x"], ["y"], name="atan")
    _check(tmp_path, _model(op, [3, 5], {"x": _randn(3, 5, scale=2.5)}))


@MERGED
@pytest.mark.parametrize("index", range(len(LARGE_INPUT_OPS)), ids=LARGE_INPUT_OPS)
def test_large_inputs_stay_finite(merged_rows: list, index: int) -> None:
    """x = +-100 and +-30: log(1 + exp(x)) would be inf in float32 from 89 on; the kernels must give
    onnxruntime's finite values, and the backward finite gradients."""
    _check_case(merged_rows, f"large{index}")


@pytest.mark.parametrize("x_shape,slope_shape", [([2, 3, 4, 4], [3, 1, 1]), ([2, 3, 5, 5], [3, 1, 1]),
                                                 ([4, 6], [6]), ([4, 6], [1]), ([2, 3, 5], [1])])
def test_prelu(tmp_path, x_shape: list[int], slope_shape: list[int]) -> None:
    """nn.PReLU's slopes: per channel ([C, 1, 1] on NCHW, [C] on [N, C]) or one shared ([1])."""
    slope = np.abs(_randn(*slope_shape, seed=3)) * 0.3
    op = helper.make_node("PRelu", ["x", "slope"], ["y"], name="prelu")
    _check(tmp_path, _op_then_loss(op, x_shape, {"x": _randn(*x_shape, scale=2.0), "slope": slope}))


def test_prelu_fused_after_conv(tmp_path) -> None:
    """Conv then PReLU per channel: the activation runs in the conv's epilogue, reading the slope per channel."""
    extra = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv")]
    op = helper.make_node("PRelu", ["c", "slope"], ["y"], name="act")
    inits = {"x": _randn(1, 3, 5, 5), "w": _randn(4, 3, 3, 3, seed=2),
             "slope": np.array([0.1, 0.25, -0.2, 0.5], np.float32).reshape(4, 1, 1)}
    model = _op_then_loss(op, [1, 4, 5, 5], inits, extra=extra)
    _assert_fused(tmp_path, model, "conv", "act")
    _check(tmp_path, model)


@pytest.mark.parametrize("op_type,attributes", [("Gelu", {}), ("Mish", {}), ("Elu", {"alpha": 0.5}),
                                                ("Softplus", {})], ids=_ids)
def test_activation_fused_after_matmul(tmp_path, op_type: str, attributes: dict[str, object]) -> None:
    """MatMul then the activation (a transformer MLP's first half): the activation is the MatMul's epilogue."""
    extra = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc")]
    op = helper.make_node(op_type, ["h"], ["y"], name="act", **attributes)
    model = _model(op, [6, 12], {"x": _randn(6, 8), "w": _randn(8, 12, seed=2)}, extra=extra)
    _assert_fused(tmp_path, model, "fc", "act")
    _check(tmp_path, model)


def test_exact_gelu_after_a_matmul_in_buffers(tmp_path) -> None:
    """Exact Gelu (the preamble's erf_rational, as Erf's) in a MatMul's epilogue, in buffer storage too:
    onnxruntime's numbers (test_unary_activation and test_activation_fused_after_matmul: image storage)."""
    extra = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc")]
    op = helper.make_node("Gelu", ["h"], ["y"], name="act")
    path = str(tmp_path / "model.onnx")
    onnx.save(_model(op, [6, 12], {"x": _randn(6, 8, scale=2.0), "w": _randn(8, 12, seed=2)}, extra=extra), path)
    rows = verify_model(path, TrainingOptions(loss="output", optimizer=SGD), storage="buffer")
    assert rows and not [r for r in rows if not r.ok], [r for r in rows if not r.ok]


@MERGED
@pytest.mark.parametrize("index", range(len(ROUNDING)), ids=[_ids(ops) for ops in ROUNDING])
def test_floor_and_sign(merged_rows: list, index: int) -> None:
    """Rounding ops on the model input x (random normal feeds): y = w * f(x), whose backward reads
    f(x) (dw = f(x) dy). Sign(Floor(x)) meets exact zeros (x in [0, 1))."""
    _check_case(merged_rows, f"rounding{index}")


@MERGED
@pytest.mark.parametrize("index", range(len(VARIADIC)), ids=[f"{_ids(shapes)}-{op}" for op, shapes in VARIADIC])
def test_variadic(merged_rows: list, index: int) -> None:
    """Broadcasting inputs (the backward unbroadcasts each), with ties between the first two."""
    _check_case(merged_rows, f"variadic{index}")


@pytest.mark.parametrize("storage", ["image", "buffer"])
def test_small_integer_powers_are_products(tmp_path, storage: str) -> None:
    """Pow by a constant integer exponent of magnitude up to 4 (GELU's x^3) is computed by multiplications, not
    OpenCL's pown (a library call of about 200 ns per element on PoCL): none in the kernels, the step equal to
    onnxruntime's in both storages (exponents 3, -2, 4, -3; and their gradients' x^2, x^-3, x^3, x^-4)."""
    shape = [3, 8]
    exponents = {"p3": 3, "pm2": -2, "p4": 4, "pm3": -3}
    extra = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(e, np.float32)),
                              name=f"c_{name}") for name, e in exponents.items()]
    extra += [helper.make_node("Pow", ["x", name], [f"y_{name}"], name=f"pow_{name}") for name in exponents]
    names = [f"y_{name}" for name in exponents]
    extra += [helper.make_node("Sum", names[:-1], ["partial"], name="sum_powers")]
    op = helper.make_node("Add", ["partial", names[-1]], ["y"], name="add_powers")
    x = _randn(*shape, scale=1.5)
    x = np.where(np.abs(x) < 0.5, np.sign(x) * 0.5 + x, x).astype(np.float32)  # away from 0 (negative powers)
    path = str(tmp_path / "model.onnx")
    onnx.save(_op_then_loss(op, shape, {"x": x}, extra=extra), path)
    bundle = str(tmp_path / "bundle")
    rows = verify_model(path, TrainingOptions(loss="output", optimizer=SGD), storage=storage, keep_bundle=bundle)
    assert rows and not [r for r in rows if not r.ok]
    with open(f"{bundle}/kernels.cl") as source:
        assert "pown(" not in source.read()
