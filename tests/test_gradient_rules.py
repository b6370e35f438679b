"""Every gradient rule of the registry against PyTorch autograd, through the whole pipeline.

Each case is a tiny opset-18 model: the op under test, its float operands as initializers
(so they train), then `ReduceSum(Mul(y, R))` with R a fixed random constant, so every output
element has its own upstream gradient. The step graph from `build_training_graph` runs in
onnxruntime; its loss and every `P.grad` must match float64 torch autograd of the same
expression (torch is the independent reference, used only here).
"""

from __future__ import annotations

import math
import pathlib
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler.autodiff import supported_ops
from fblc.errors import UnsupportedOpError
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions, build_training_graph

RTOL, ATOL = 1e-4, 1e-5  # fp32 step graph against a float64 reference
OPSET = 18

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    id: str
    nodes: list[onnx.NodeProto]  # the op under test; the value to differentiate is named "y"
    params: dict[str, np.ndarray]  # float initializers: they train and their gradients are checked
    reference: Callable[[Tensors], torch.Tensor]  # the same expression in torch, from params and consts
    consts: dict[str, np.ndarray] = field(default_factory=dict)  # initializers that do not train
    keep_y: bool = False  # also make y a model output, so import keeps its producer (Identity, Dropout)

    def param(self) -> object:
        return pytest.param(self, id=self.id)


_rng = np.random.default_rng(1234)


def rand(*shape: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return _rng.uniform(low, high, size=shape).astype(np.float32)


def away(*shape: int, margin: float = 0.2) -> np.ndarray:
    """Random values of either sign at least `margin` from zero (away from kinks at 0)."""
    magnitude = _rng.uniform(margin, 1.0, size=shape)
    return np.where(_rng.random(size=shape) < 0.5, -magnitude, magnitude).astype(np.float32)


def pos(*shape: int, low: float = 0.5, high: float = 2.0) -> np.ndarray:
    return rand(*shape, low=low, high=high)


def i64(values: Sequence[int] | int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def f32(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


def node(op_type: str, inputs: Sequence[str], outputs: Sequence[str] = ("y",), name: str | None = None,
         **attributes: object) -> onnx.NodeProto:
    return helper.make_node(op_type, list(inputs), list(outputs), name=name or f"{op_type.lower()}_{outputs[0]}",
                            **attributes)


def const_node(name: str, array: np.ndarray) -> onnx.NodeProto:
    """A Constant node: its value is folded at import and never trains."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))


# ---------------------------------------------------------------- harness

def _upstream(case: Case, shape: Sequence[int]) -> np.ndarray:
    """R: fixed per case (seeded by its id), distinct per output element."""
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    return rng.uniform(-1.0, 1.0, size=tuple(shape)).astype(np.float32)


def _model(case: Case, r: np.ndarray) -> onnx.ModelProto:
    initializers = [numpy_helper.from_array(v, k) for k, v in {**case.params, **case.consts}.items()]
    tail = [const_node("R", r), helper.make_node("Mul", ["y", "R"], ["weighted"]),
            helper.make_node("ReduceSum", ["weighted"], ["total"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])]
    if case.keep_y:
        outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, list(r.shape)))
    graph = helper.make_graph(case.nodes + tail, case.id, [], outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
    onnx.checker.check_model(model)
    return model


def _step(model: onnx.ModelProto, folder: pathlib.Path) -> str:
    path, step_path = str(folder / "model.onnx"), str(folder / "step.onnx")
    onnx.save(model, path)
    options = TrainingOptions(loss="output", optimizer=OptimizerConfig(name="sgd", lr=0.0))
    step = build_training_graph(load_model(path), options)
    save_model_atomically(step, step_path)
    return step_path


def _run(step_path: str) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(step_path, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {})))


def _torch_reference(case: Case) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """R, the loss and the gradient of every param, by float64 autograd."""
    tensors: Tensors = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in case.params.items()}
    for k, v in case.consts.items():
        tensors[k] = torch.tensor(v.astype(np.float64)) if v.dtype.kind == "f" else torch.from_numpy(v.copy())
    y = case.reference(tensors)
    r = _upstream(case, y.shape)
    loss = (y * torch.from_numpy(r.astype(np.float64))).sum()
    loss.backward()
    grads = {k: tensors[k].grad.numpy() if tensors[k].grad is not None else np.zeros(v.shape)
             for k, v in case.params.items()}
    return r, loss.item(), grads


def check(case: Case, folder: pathlib.Path) -> None:
    r, loss, expected = _torch_reference(case)
    got = _run(_step(_model(case, r), folder))
    np.testing.assert_allclose(got["loss"], loss, rtol=RTOL, atol=ATOL, err_msg=f"{case.id}: forward loss")
    trained = sorted(n[: -len(".grad")] for n in got if n.endswith(".grad"))
    assert trained == sorted(expected), f"{case.id}: trained {trained}, expected {sorted(expected)}"
    for name, grad in expected.items():
        assert f"{name}.grad" in got, f"{case.id}: no gradient output for {name} (outputs: {sorted(got)})"
        np.testing.assert_allclose(got[f"{name}.grad"], grad, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{case.id}: gradient of {name}")


# ---------------------------------------------------------------- torch references of windowed ops

def _torch_pads(pads: Sequence[int]) -> list[int]:
    """ONNX pads [b0, b1, .., e0, e1, ..] as F.pad's (last axis first) list."""
    rank = len(pads) // 2
    out: list[int] = []
    for axis in reversed(range(rank)):
        out += [pads[axis], pads[axis + rank]]
    return out


def _same_pads(spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
               dilations: Sequence[int], upper: bool) -> list[int]:
    """auto_pad SAME_*: output ceil(n / s); the odd pad goes to the end (UPPER) or the start (LOWER)."""
    begins, ends = [], []
    for n, k, s, d in zip(spatial, kernel, strides, dilations):
        total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
        small, large = total // 2, total - total // 2
        begins.append(small if upper else large)
        ends.append(large if upper else small)
    return begins + ends


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d}


def torch_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, strides: Sequence[int],
               pads: Sequence[int], dilations: Sequence[int], groups: int = 1) -> torch.Tensor:
    return _CONV[x.dim() - 2](F.pad(x, _torch_pads(pads)), w, b, stride=list(strides), dilation=list(dilations),
                              groups=groups)


def torch_avg_pool(x: torch.Tensor, kernel: Sequence[int], strides: Sequence[int], pads: Sequence[int],
                   count_include_pad: bool) -> torch.Tensor:
    """Window sums by a depthwise conv of ones; divisor the kernel size or the count of real taps."""
    channels = x.shape[1]
    ones = torch.ones((channels, 1, *kernel), dtype=x.dtype)
    sums = torch_conv(x, ones, None, strides, pads, [1] * len(kernel), groups=channels)
    if count_include_pad:
        return sums / math.prod(kernel)
    return sums / torch_conv(torch.ones_like(x), ones, None, strides, pads, [1] * len(kernel), groups=channels)


def torch_max_pool(x: torch.Tensor, kernel: Sequence[int], strides: Sequence[int], pads: Sequence[int],
                   dilations: Sequence[int] | None = None) -> torch.Tensor:
    padded = F.pad(x, _torch_pads(pads), value=-math.inf)
    return _MAX_POOL[x.dim() - 2](padded, list(kernel), list(strides), dilation=list(dilations or [1] * len(kernel)))


def torch_slice(x: torch.Tensor, starts: Sequence[int], ends: Sequence[int], axes: Sequence[int],
                steps: Sequence[int]) -> torch.Tensor:
    """numpy slicing semantics (negative steps included) via index_select."""
    for start, end, axis, step in zip(starts, ends, axes, steps):
        picked = np.arange(x.shape[axis])[slice(start, end, step)]
        x = torch.index_select(x, axis % x.dim(), torch.from_numpy(picked.astype(np.int64)))
    return x


# ---------------------------------------------------------------- cases

def binary(op_type: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], label: str,
           a: np.ndarray, b: np.ndarray) -> Case:
    return Case(f"{op_type}-{label}", [node(op_type, ["a", "b"])], {"a": a, "b": b},
                lambda t: fn(t["a"], t["b"]))


def unary(op_type: str, fn: Callable[[torch.Tensor], torch.Tensor], x: np.ndarray, label: str = "",
          **attributes: object) -> Case:
    return Case(f"{op_type}{'-' + label if label else ''}", [node(op_type, ["x"], **attributes)], {"x": x},
                lambda t: fn(t["x"]))


def elementwise_cases() -> list[Case]:
    cases: list[Case] = []
    ops = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}
    for op_type, fn in ops.items():
        divisor = op_type == "Div"
        cases.append(binary(op_type, fn, "same-shape", rand(3, 4), away(3, 4) if divisor else rand(3, 4)))
        # both operands broadcast, and b gains a rank: (2,1,4) op (3,1) -> (2,3,4)
        cases.append(binary(op_type, fn, "both-broadcast-rank", rand(2, 1, 4), away(3, 1) if divisor else rand(3, 1)))
        cases.append(binary(op_type, fn, "scalar-rhs", rand(2, 3), away() if divisor else rand()))
        cases.append(binary(op_type, fn, "lhs-broadcast", rand(4), away(3, 2, 4) if divisor else rand(3, 2, 4)))
    cases.append(binary("Pow", torch.pow, "same-shape", pos(3, 4), rand(3, 4, low=-1.5, high=2.5)))
    cases.append(binary("Pow", torch.pow, "both-broadcast-rank", pos(2, 1, 4), rand(3, 1, low=-1.5, high=2.5)))
    cases.append(Case("Pow-int-exponent", [node("Pow", ["x", "p"])], {"x": away(3, 4)},
                      lambda t: torch.pow(t["x"], 3), consts={"p": i64(3)}))
    cases.append(Case("Pow-const-float-exponent", [const_node("p", f32(1.5)), node("Pow", ["x", "p"])],
                      {"x": pos(3, 4)}, lambda t: torch.pow(t["x"], 1.5)))

    condition = _rng.random((2, 1, 4)) < 0.5
    cases.append(Case("Where-both-broadcast-rank", [node("Where", ["c", "a", "b"])], {"a": rand(3, 1), "b": rand(4)},
                      lambda t: torch.where(t["c"], t["a"], t["b"]), consts={"c": condition}))
    cases.append(Case("Where-same-shape", [node("Where", ["c", "a", "b"])], {"a": rand(3, 4), "b": rand(3, 4)},
                      lambda t: torch.where(t["c"], t["a"], t["b"]), consts={"c": _rng.random((3, 4)) < 0.5}))

    cases += [
        unary("Sqrt", torch.sqrt, pos(3, 4)),
        unary("Reciprocal", torch.reciprocal, away(3, 4, margin=0.5)),
        unary("Exp", torch.exp, rand(3, 4)),
        unary("Log", torch.log, pos(3, 4)),
        unary("Sigmoid", torch.sigmoid, rand(3, 4, low=-3, high=3)),
        unary("Tanh", torch.tanh, rand(3, 4, low=-2, high=2)),
        unary("Erf", torch.erf, rand(3, 4, low=-2, high=2)),
        unary("Sin", torch.sin, rand(3, 4, low=-3, high=3)),
        unary("Cos", torch.cos, rand(3, 4, low=-3, high=3)),
        unary("Neg", torch.neg, rand(3, 4)),
        unary("Relu", torch.relu, away(3, 4)),
        unary("Cast", lambda x: x, rand(3, 4), "float-to-float", to=TensorProto.FLOAT),
        Case("Cast-float-double-float", [node("Cast", ["x"], ["x64"], to=TensorProto.DOUBLE),
                                         node("Cast", ["x64"], to=TensorProto.FLOAT)],
             {"x": rand(3, 4)}, lambda t: t["x"]),
        # import removes Identity and inference Dropout unless their output is a model output
        Case("Identity", [node("Identity", ["x"])], {"x": rand(3, 4)}, lambda t: t["x"], keep_y=True),
        Case("Dropout-inference", [node("Dropout", ["x"])], {"x": rand(3, 4)}, lambda t: t["x"], keep_y=True),
        Case("Dropout-inference-ratio", [node("Dropout", ["x", "ratio"])], {"x": rand(3, 4)}, lambda t: t["x"],
             consts={"ratio": f32(0.3)}, keep_y=True),
    ]

    # Clip: values at least 0.1 from the bounds, on both sides of them
    x = rand(3, 5, low=-2.0, high=8.0)
    x = np.where(np.abs(x) < 0.1, x + 0.3, x)
    x = np.where(np.abs(x - 6) < 0.1, x + 0.3, x).astype(np.float32)
    cases += [
        Case("Clip-min-only", [const_node("lo", f32(0.0)), node("Clip", ["x", "lo"])], {"x": x},
             lambda t: torch.clamp(t["x"], min=0.0)),
        Case("Clip-relu6", [const_node("lo", f32(0.0)), const_node("hi", f32(6.0)), node("Clip", ["x", "lo", "hi"])],
             {"x": x}, lambda t: F.hardtanh(t["x"], 0.0, 6.0)),
        Case("Clip-max-only", [const_node("hi", f32(6.0)), node("Clip", ["x", "", "hi"])], {"x": x},
             lambda t: torch.clamp(t["x"], max=6.0)),
        Case("Clip-no-bounds", [node("Clip", ["x"])], {"x": x}, lambda t: t["x"]),
        # bounds that are initializers train too: each gets the gradient of the elements it clips
        Case("Clip-trained-bounds", [node("Clip", ["x", "lo", "hi"])], {"x": x, "lo": f32(0.0), "hi": f32(6.0)},
             lambda t: torch.clamp(t["x"], t["lo"], t["hi"])),
    ]
    # Atan (added by docs/ARCHITECTURE.md's recipe): a stream of its own, so no later case's inputs move
    wide = np.random.default_rng(38).uniform(-4.0, 4.0, size=(3, 4)).astype(np.float32)
    cases.append(unary("Atan", torch.atan, wide))
    return cases


def linalg_cases() -> list[Case]:
    cases: list[Case] = []
    for label, a, b in [("2d", rand(3, 4), rand(4, 5)),
                        ("batched", rand(2, 3, 4), rand(2, 4, 5)),
                        ("broadcast-batch", rand(2, 1, 3, 4), rand(3, 4, 5)),
                        ("rhs-2d-broadcast", rand(2, 3, 4), rand(4, 5)),
                        ("rhs-2d-batch-1", rand(1, 3, 4), rand(4, 5)),
                        ("lhs-1d", rand(4), rand(2, 4, 5)),
                        ("rhs-1d", rand(2, 3, 4), rand(4)),
                        ("both-1d", rand(4), rand(4))]:
        cases.append(binary("MatMul", torch.matmul, label, a, b))

    def gemm(label: str, a: np.ndarray, b: np.ndarray, c: np.ndarray | None, alpha: float = 1.0, beta: float = 1.0,
             trans_a: int = 0, trans_b: int = 0) -> Case:
        params = {"a": a, "b": b} | ({"c": c} if c is not None else {})

        def reference(t: Tensors) -> torch.Tensor:
            left = t["a"].T if trans_a else t["a"]
            right = t["b"].T if trans_b else t["b"]
            out = alpha * (left @ right)
            return out + beta * t["c"] if c is not None else out

        inputs = ["a", "b"] + (["c"] if c is not None else [])
        return Case(f"Gemm-{label}", [node("Gemm", inputs, alpha=alpha, beta=beta, transA=trans_a, transB=trans_b)],
                    params, reference)

    cases += [
        gemm("plain", rand(3, 4), rand(4, 5), rand(3, 5)),
        gemm("no-c", rand(3, 4), rand(4, 5), None),
        gemm("transA", rand(4, 3), rand(4, 5), rand(5), trans_a=1),
        gemm("transB", rand(3, 4), rand(5, 4), rand(1, 5), trans_b=1),
        gemm("transA-transB-alpha-beta-c-column", rand(4, 3), rand(5, 4), rand(3, 1), alpha=0.7, beta=1.3,
             trans_a=1, trans_b=1),
        gemm("alpha-beta-scalar-c", rand(3, 4), rand(4, 5), rand(), alpha=-0.5, beta=0.25),
    ]

    def conv(label: str, x: np.ndarray, w: np.ndarray, bias: bool = True, strides: Sequence[int] | None = None,
             pads: Sequence[int] | None = None, dilations: Sequence[int] | None = None, group: int = 1,
             auto_pad: str | None = None) -> Case:
        rank = x.ndim - 2
        kernel = w.shape[2:]
        s, d = list(strides or [1] * rank), list(dilations or [1] * rank)
        attributes: dict[str, object] = {"group": group}
        if strides:
            attributes["strides"] = list(strides)
        if dilations:
            attributes["dilations"] = list(dilations)
        if auto_pad:
            attributes["auto_pad"] = auto_pad
            torch_pads = ([0] * 2 * rank if auto_pad == "VALID"
                          else _same_pads(x.shape[2:], kernel, s, d, upper=auto_pad == "SAME_UPPER"))
        else:
            torch_pads = list(pads or [0] * 2 * rank)
            if pads:
                attributes["pads"] = list(pads)
        params = {"x": x, "w": w} | ({"bias": rand(w.shape[0])} if bias else {})
        inputs = ["x", "w"] + (["bias"] if bias else [])
        return Case(f"Conv-{label}", [node("Conv", inputs, **attributes)], params,
                    lambda t: torch_conv(t["x"], t["w"], t.get("bias"), s, torch_pads, d, group))

    cases += [
        conv("basic-pad1", rand(2, 3, 5, 5), rand(4, 3, 3, 3), pads=[1, 1, 1, 1]),
        conv("no-bias", rand(2, 3, 5, 4), rand(2, 3, 3, 2), bias=False),
        conv("grouped", rand(2, 4, 5, 5), rand(6, 2, 3, 3), pads=[1, 1, 1, 1], group=2),
        conv("depthwise", rand(2, 3, 5, 5), rand(3, 1, 3, 3), pads=[1, 1, 1, 1], group=3),
        conv("depthwise-multiplier2-stride2", rand(1, 3, 6, 6), rand(6, 1, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1],
             group=3),
        conv("stride2-pad1", rand(2, 2, 7, 7), rand(3, 2, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
        conv("asymmetric-pads", rand(1, 2, 5, 6), rand(3, 2, 3, 3), pads=[0, 2, 1, 0]),
        conv("dilation2", rand(1, 2, 7, 7), rand(3, 2, 3, 3), pads=[2, 2, 2, 2], dilations=[2, 2]),
        conv("grouped-stride-dilation-asymmetric", rand(2, 4, 9, 8), rand(4, 2, 3, 2), strides=[2, 3],
             pads=[1, 0, 2, 1], dilations=[2, 1], group=2),
        conv("same-upper-stride2", rand(1, 2, 6, 6), rand(3, 2, 3, 3), strides=[2, 2], auto_pad="SAME_UPPER"),
        conv("same-lower-stride2", rand(1, 2, 6, 6), rand(3, 2, 3, 3), strides=[2, 2], auto_pad="SAME_LOWER"),
        conv("same-upper-even-kernel", rand(1, 2, 5, 5), rand(3, 2, 2, 2), auto_pad="SAME_UPPER"),
        conv("same-lower-even-kernel", rand(1, 2, 5, 5), rand(3, 2, 2, 2), auto_pad="SAME_LOWER"),
        conv("valid-stride2", rand(1, 2, 7, 6), rand(3, 2, 3, 3), strides=[2, 2], auto_pad="VALID"),
        conv("1d-stride2", rand(2, 3, 9), rand(4, 3, 3), strides=[2], pads=[1, 0]),
        conv("temporal-k1", rand(1, 3, 8, 4), rand(5, 3, 3, 1), pads=[1, 0, 1, 0]),
        # rows/cols 5 are read by no window: their input gradient is zero
        conv("stride-uncovered-last-row", rand(2, 2, 6, 6), rand(3, 2, 3, 3), strides=[2, 2]),
        conv("stride-uncovered-1d", rand(1, 2, 8), rand(2, 2, 3), strides=[3]),
    ]

    # values of their own: drawing from the shared stream would change every case built after these
    # (the other modules' cases take it on from here), some of which sit close to a tolerance
    own = np.random.default_rng(7)

    def draw(*shape: int) -> np.ndarray:
        return own.uniform(-1.0, 1.0, size=shape).astype(np.float32)

    def conv_transpose(label: str, x: np.ndarray, w: np.ndarray, strides: list[int], pad: int, group: int = 1,
                       output_padding: list[int] | None = None, dilation: int = 1) -> Case:
        """ConvTranspose with torch's symmetric padding (ONNX pads [p, p, p, p] = torch padding p)."""
        rank = x.ndim - 2
        attributes: dict[str, object] = {"group": group, "strides": strides, "pads": [pad] * 2 * rank,
                                         "dilations": [dilation] * rank}
        if output_padding:
            attributes["output_padding"] = output_padding
        transpose = F.conv_transpose2d if rank == 2 else F.conv_transpose1d
        return Case(f"ConvTranspose-{label}", [node("ConvTranspose", ["x", "w", "bias"], **attributes)],
                    {"x": x, "w": w, "bias": draw(w.shape[1] * group)},
                    lambda t: transpose(t["x"], t["w"], t["bias"], stride=strides, padding=pad,
                                        output_padding=output_padding or 0, groups=group, dilation=dilation))

    cases += [
        conv_transpose("stride2-pad1", draw(2, 3, 4, 4), draw(3, 2, 3, 3), strides=[2, 2], pad=1),
        conv_transpose("grouped-output-padding", draw(1, 4, 3, 5), draw(4, 3, 3, 2), strides=[2, 3], pad=0,
                       group=2, output_padding=[1, 2]),
        conv_transpose("1d-dilation2", draw(2, 2, 6), draw(2, 3, 3), strides=[1], pad=1, dilation=2),
    ]

    def conv_transpose_sized(label: str, x: np.ndarray, w: np.ndarray, crop: tuple[slice, ...],
                             **attributes: object) -> Case:
        """ConvTranspose sized by auto_pad or output_shape (pads derived as the ONNX spec says): torch's
        unpadded transpose, cropped to the same window."""
        return Case(f"ConvTranspose-{label}", [node("ConvTranspose", ["x", "w", "bias"], strides=[2, 2], **attributes)],
                    {"x": x, "w": w, "bias": draw(w.shape[1])},
                    lambda t: F.conv_transpose2d(t["x"], t["w"], t["bias"], stride=2)[(..., *crop)])

    cases += [  # the natural 7 x 11 (7 x 9) output, one row and column cut: at the end, at the start
        conv_transpose_sized("same-upper", draw(1, 2, 3, 5), draw(2, 3, 3, 3), (slice(0, 6), slice(0, 10)),
                             auto_pad="SAME_UPPER"),
        conv_transpose_sized("output-shape", draw(1, 2, 3, 4), draw(2, 3, 3, 3), (slice(1, 7), slice(1, 9)),
                             output_shape=[6, 8]),
    ]

    def batch_norm(label: str, shape: tuple[int, ...]) -> Case:
        channels = shape[1]
        return Case(f"BatchNormalization-{label}",
                    [node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], epsilon=1e-3, training_mode=0)],
                    {"x": rand(*shape), "scale": rand(channels), "bias": rand(channels)},
                    lambda t: F.batch_norm(t["x"], t["mean"], t["var"], t["scale"], t["bias"], training=False,
                                           eps=1e-3),
                    consts={"mean": rand(channels), "var": pos(channels)})

    cases += [batch_norm("eval-4d", (2, 3, 4, 4)), batch_norm("eval-3d", (2, 3, 5)),
              # statistics that trainable values compute (a weight-standardised conv's ReduceMeans of its weight):
              # through a Mul, as trainable statistics reach BatchNormalization from a computation, not a state
              Case("BatchNormalization-trainable-statistics",
                   [node("Mul", ["m", "m"], ["mean"]), node("Mul", ["v", "v"], ["var"]),
                    node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], epsilon=1e-3, training_mode=0)],
                   {"x": rand(2, 3, 4, 4), "scale": rand(3), "bias": rand(3), "m": rand(3), "v": pos(3)},
                   lambda t: ((t["x"] - (t["m"] * t["m"]).view(1, 3, 1, 1))
                              / torch.sqrt((t["v"] * t["v"]).view(1, 3, 1, 1) + 1e-3)
                              * t["scale"].view(1, 3, 1, 1) + t["bias"].view(1, 3, 1, 1)))]

    def layer_norm(label: str, shape: tuple[int, ...], axis: int, bias: bool = True) -> Case:
        normalized = shape[axis:]
        params = {"x": rand(*shape), "scale": rand(*normalized)} | ({"bias": rand(*normalized)} if bias else {})
        inputs = ["x", "scale"] + (["bias"] if bias else [])
        return Case(f"LayerNormalization-{label}", [node("LayerNormalization", inputs, axis=axis, epsilon=1e-5)],
                    params, lambda t: F.layer_norm(t["x"], normalized, t["scale"], t.get("bias"), eps=1e-5))

    cases += [layer_norm("last-axis", (2, 3, 6), -1), layer_norm("last-2-axes", (2, 3, 4), -2),
              layer_norm("last-axis-no-bias", (4, 5), 1, bias=False)]
    return cases


def pooling_cases() -> list[Case]:
    cases: list[Case] = []

    def avg(label: str, x: np.ndarray, kernel: list[int], strides: list[int] | None = None,
            pads: list[int] | None = None, count_include_pad: int = 0) -> Case:
        rank = len(kernel)
        attributes: dict[str, object] = {"kernel_shape": kernel, "count_include_pad": count_include_pad}
        if strides:
            attributes["strides"] = strides
        if pads:
            attributes["pads"] = pads
        s, p = strides or [1] * rank, pads or [0] * 2 * rank
        return Case(f"AveragePool-{label}", [node("AveragePool", ["x"], **attributes)], {"x": x},
                    lambda t: torch_avg_pool(t["x"], kernel, s, p, bool(count_include_pad)))

    cases += [
        avg("k2-s2", rand(2, 3, 4, 4), [2, 2], [2, 2]),
        avg("overlapping-k3-s1", rand(1, 2, 5, 5), [3, 3]),
        avg("pad1-exclude-pad", rand(2, 2, 5, 5), [3, 3], [2, 2], [1, 1, 1, 1], count_include_pad=0),
        avg("pad1-include-pad", rand(2, 2, 5, 5), [3, 3], [2, 2], [1, 1, 1, 1], count_include_pad=1),
        avg("asymmetric-pad-exclude", rand(1, 2, 5, 6), [3, 2], [1, 2], [0, 1, 2, 0], count_include_pad=0),
        avg("1d-pad-include", rand(2, 3, 7), [3], [2], [1, 1], count_include_pad=1),
        avg("stride-uncovered", rand(1, 2, 6, 6), [3, 3], [2, 2]),
    ]

    def max_pool(label: str, x: np.ndarray, kernel: list[int], strides: list[int] | None = None,
                 pads: list[int] | None = None, dilations: list[int] | None = None) -> Case:
        rank = len(kernel)
        attributes: dict[str, object] = {"kernel_shape": kernel}
        if strides:
            attributes["strides"] = strides
        if pads:
            attributes["pads"] = pads
        if dilations:
            attributes["dilations"] = dilations
        s, p = strides or [1] * rank, pads or [0] * 2 * rank
        return Case(f"MaxPool-{label}", [node("MaxPool", ["x"], **attributes)], {"x": x},
                    lambda t: torch_max_pool(t["x"], kernel, s, p, dilations))

    cases += [
        max_pool("k2-s2", rand(2, 3, 4, 4), [2, 2], [2, 2]),
        max_pool("overlapping-k3-s1-pad1", rand(2, 2, 5, 5), [3, 3], [1, 1], [1, 1, 1, 1]),
        max_pool("overlapping-k3-s2-pad1", rand(2, 3, 7, 7), [3, 3], [2, 2], [1, 1, 1, 1]),
        max_pool("asymmetric-pad", rand(1, 2, 5, 6), [2, 3], [1, 2], [1, 0, 0, 1]),
        max_pool("dilation2", rand(1, 2, 7, 7), [2, 2], [1, 1], None, [2, 2]),
        max_pool("1d", rand(2, 2, 9), [3], [2], [1, 1]),
    ]
    cases.append(unary("GlobalAveragePool", lambda x: x.mean(dim=(2, 3), keepdim=True), rand(2, 3, 4, 5)))
    cases.append(unary("GlobalAveragePool", lambda x: x.mean(dim=2, keepdim=True), rand(2, 3, 6), "1d"))
    return cases


def reduce_cases() -> list[Case]:
    cases: list[Case] = []

    def reduce(op_type: str, fn: Callable[[torch.Tensor, list[int] | None, bool], torch.Tensor], x: np.ndarray,
               axes: list[int] | None, keepdims: int, suffix: str = "") -> Case:
        label = f"axes{'_'.join(map(str, axes)) if axes else '-all'}-keepdims{keepdims}{suffix}"
        inputs = ["x", "axes"] if axes is not None else ["x"]
        consts = {"axes": i64(axes)} if axes is not None else {}
        return Case(f"{op_type}-{label}", [node(op_type, inputs, keepdims=keepdims)], {"x": x},
                    lambda t: fn(t["x"], axes, bool(keepdims)), consts=consts)

    def torch_sum(x: torch.Tensor, axes: list[int] | None, keep: bool) -> torch.Tensor:
        return x.sum(dim=axes, keepdim=keep) if axes else (x.sum().reshape([1] * x.dim()) if keep else x.sum())

    def torch_mean(x: torch.Tensor, axes: list[int] | None, keep: bool) -> torch.Tensor:
        return x.mean(dim=axes, keepdim=keep) if axes else (x.mean().reshape([1] * x.dim()) if keep else x.mean())

    def torch_amax(x: torch.Tensor, axes: list[int] | None, keep: bool) -> torch.Tensor:
        return torch.amax(x, dim=axes if axes else list(range(x.dim())), keepdim=keep)

    cases.append(Case("ReduceSum-noop-with-empty-axes", [node("ReduceSum", ["x"], noop_with_empty_axes=1)],
                      {"x": rand(2, 3)}, lambda t: t["x"]))
    for axes, keepdims in [([1], 1), ([-1], 0), ([0, -1], 0), ([-2], 1), (None, 0), (None, 1)]:
        cases.append(reduce("ReduceSum", torch_sum, rand(2, 3, 4), axes, keepdims))
        cases.append(reduce("ReduceMean", torch_mean, rand(2, 3, 4), axes, keepdims))
    # ReduceMax with ties: small integers repeat along every axis; torch.amax shares the gradient
    ties = _rng.integers(0, 3, size=(2, 3, 4)).astype(np.float32)
    for axes, keepdims in [([1], 0), ([-1], 1), ([0, 2], 0), (None, 0)]:
        cases.append(reduce("ReduceMax", torch_amax, ties.copy(), axes, keepdims, "-ties"))
    cases.append(reduce("ReduceMax", torch_amax, rand(3, 5), [1], 0, "-distinct"))

    for op_type, fn in (("Softmax", torch.softmax), ("LogSoftmax", torch.log_softmax)):
        for axis in (1, -1):
            cases.append(unary(op_type, lambda x, fn=fn, axis=axis: fn(x, axis), rand(2, 3, 4, low=-2, high=2),
                               f"axis{axis}", axis=axis))
    return cases


def tensor_cases() -> list[Case]:
    cases: list[Case] = []
    cases += [
        Case("Reshape-infer-dim", [node("Reshape", ["x", "shape"])], {"x": rand(2, 3, 4)},
             lambda t: t["x"].reshape(-1, 6), consts={"shape": i64([-1, 6])}),
        Case("Reshape-copy-dim", [node("Reshape", ["x", "shape"])], {"x": rand(2, 3, 4)},
             lambda t: t["x"].reshape(2, 12), consts={"shape": i64([0, 12])}),
        Case("Flatten-axis2", [node("Flatten", ["x"], axis=2)], {"x": rand(2, 3, 4, 5)},
             lambda t: t["x"].reshape(6, 20)),
        Case("Flatten-default", [node("Flatten", ["x"])], {"x": rand(2, 3, 4)}, lambda t: t["x"].reshape(2, 12)),
        Case("Squeeze-axes", [node("Squeeze", ["x", "axes"])], {"x": rand(2, 1, 4, 1)},
             lambda t: t["x"].squeeze(1), consts={"axes": i64([1])}),
        Case("Squeeze-all", [node("Squeeze", ["x"])], {"x": rand(2, 1, 4, 1)}, lambda t: t["x"].reshape(2, 4)),
        Case("Unsqueeze-negative-axes", [node("Unsqueeze", ["x", "axes"])], {"x": rand(3, 4)},
             lambda t: t["x"].reshape(1, 3, 4, 1), consts={"axes": i64([0, -1])}),
        Case("Transpose-perm", [node("Transpose", ["x"], perm=[2, 0, 1])], {"x": rand(2, 3, 4)},
             lambda t: t["x"].permute(2, 0, 1)),
        Case("Transpose-perm-4d", [node("Transpose", ["x"], perm=[0, 2, 3, 1])], {"x": rand(2, 3, 4, 5)},
             lambda t: t["x"].permute(0, 2, 3, 1)),
        Case("Transpose-default-reverse", [node("Transpose", ["x"])], {"x": rand(2, 3, 4)},
             lambda t: t["x"].permute(2, 1, 0)),
        Case("Expand-rank-and-size", [node("Expand", ["x", "shape"])], {"x": rand(3, 1)},
             lambda t: t["x"].expand(2, 3, 4), consts={"shape": i64([2, 3, 4])}),
        Case("Expand-ones-in-shape", [node("Expand", ["x", "shape"])], {"x": rand(1, 4)},
             lambda t: t["x"].expand(3, 4), consts={"shape": i64([3, 1])}),
        Case("Concat-3-inputs", [node("Concat", ["a", "b", "c"], axis=1)],
             {"a": rand(2, 1, 3), "b": rand(2, 3, 3), "c": rand(2, 2, 3)},
             lambda t: torch.cat([t["a"], t["b"], t["c"]], dim=1)),
        Case("Concat-negative-axis", [node("Concat", ["a", "b", "c"], axis=-1)],
             {"a": rand(2, 2), "b": rand(2, 3), "c": rand(2, 1)},
             lambda t: torch.cat([t["a"], t["b"], t["c"]], dim=-1)),
        Case("Split-unequal-only-last-used", [node("Split", ["x", "split"], ["s0", "s1", "y"], axis=1)],
             {"x": rand(2, 6, 3)}, lambda t: torch.split(t["x"], [1, 3, 2], dim=1)[2],
             consts={"split": i64([1, 3, 2])}),
        Case("Split-unequal-middle-unused", [node("Split", ["x", "split"], ["s0", "s1", "s2"], axis=-1),
                                             node("Concat", ["s2", "s0"], axis=-1)],
             {"x": rand(2, 6)}, lambda t: torch.cat([t["x"][:, 4:], t["x"][:, :1]], dim=-1),
             consts={"split": i64([1, 3, 2])}),
        Case("Split-num-outputs", [node("Split", ["x"], ["y", "s1", "s2"], axis=0, num_outputs=3)],
             {"x": rand(7, 2)}, lambda t: t["x"][:3]),
    ]

    def slice_case(label: str, shape: tuple[int, ...], starts: list[int], ends: list[int], axes: list[int] | None,
                   steps: list[int] | None) -> Case:
        inputs = ["x", "starts", "ends"] + (["axes"] if axes is not None or steps is not None else [])
        consts = {"starts": i64(starts), "ends": i64(ends)}
        if len(inputs) > 3:
            consts["axes"] = i64(axes if axes is not None else list(range(len(starts))))
        if steps is not None:
            inputs.append("steps")
            consts["steps"] = i64(steps)
        ref_axes = axes if axes is not None else list(range(len(starts)))
        ref_steps = steps if steps is not None else [1] * len(starts)
        return Case(f"Slice-{label}", [node("Slice", inputs)], {"x": rand(*shape)},
                    lambda t: torch_slice(t["x"], starts, ends, ref_axes, ref_steps), consts=consts)

    cases += [
        slice_case("contiguous", (4, 6), [1, 2], [3, 5], None, None),
        slice_case("step2", (7, 5), [1], [7], [0], [2]),
        slice_case("step3-two-axes", (7, 8), [0, 1], [7, 8], [0, 1], [3, 2]),
        slice_case("negative-step", (6, 4), [4], [0], [0], [-2]),
        slice_case("reverse-all", (5, 3), [-1], [-(2 ** 62)], [-1], [-1]),
        slice_case("negative-starts-ends-axes", (3, 4, 6), [-4, -3], [-1, 4], [-1, -2], None),
        slice_case("negative-axes-steps", (3, 4, 6), [-1, 0], [-6, 4], [-1, 1], [-2, 3]),
        slice_case("end-past-size", (4, 5), [2], [100], [1], None),
    ]

    def pad_case(label: str, shape: tuple[int, ...], pads: list[int], axes: list[int] | None = None,
                 mode: str = "constant") -> Case:
        inputs = ["x", "pads"] + (["", "axes"] if axes is not None else [])
        consts = {"pads": i64(pads)} | ({"axes": i64(axes)} if axes is not None else {})
        rank = len(shape)
        full = [0] * 2 * rank
        for k, axis in enumerate(axes if axes is not None else range(rank)):
            full[axis % rank] = pads[k]
            full[axis % rank + rank] = pads[k + len(pads) // 2]
        if mode == "constant":
            return Case(f"Pad-{label}", [node("Pad", inputs)], {"x": rand(*shape)},
                        lambda t: F.pad(t["x"], _torch_pads(full)), consts=consts)
        torch_pads = _torch_pads(full)
        while not any(torch_pads[-2:]):
            torch_pads = torch_pads[:-2]  # torch pads the last axes only (of a batch): leave the unpadded ones
        torch_mode = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode]
        return Case(f"Pad-{label}", [node("Pad", inputs, mode=mode)], {"x": rand(*shape)},
                    lambda t: F.pad(t["x"][None], torch_pads, mode=torch_mode)[0], consts=consts)

    cases += [
        pad_case("positive", (2, 3), [1, 0, 2, 1]),
        pad_case("negative-crop", (5, 6), [-1, -2, -1, 0]),
        pad_case("mixed-signs", (4, 5), [1, -2, -1, 2]),
        pad_case("axes-negative-pads", (2, 4, 5), [-1, 2, 1, -2], axes=[-1, 1]),
        # torch.stft's center=True (reflect), F.pad replicate and circular: the padded positions' dy flows back
        pad_case("reflect-two-axes", (2, 5, 6), [0, 2, 1, 0, 1, 3], mode="reflect"),
        pad_case("edge-two-axes", (2, 4, 5), [0, 3, 1, 0, 2, 2], mode="edge"),
        pad_case("wrap-last-axis", (3, 6), [2, 3], axes=[-1], mode="wrap"),
        # constant_value: a Constant is folded and stays fixed; an initializer trains and gets the padded dy
        Case("Pad-constant-value-fixed", [const_node("v", f32(0.7)), node("Pad", ["x", "pads", "v"])],
             {"x": rand(3, 4)}, lambda t: F.pad(t["x"], [2, 0, 1, 1], value=0.7), consts={"pads": i64([1, 2, 1, 0])}),
        Case("Pad-constant-value-trained-mixed-signs", [node("Pad", ["x", "pads", "v"])],
             {"x": rand(4, 5), "v": f32(0.7)}, lambda t: F.pad(t["x"] - t["v"], [-2, 2, 1, -1]) + t["v"],
             consts={"pads": i64([1, -2, -1, 2])}),
    ]

    indices = i64([[0, 2, 2, 4], [-1, 0, 4, 2]])  # repeated rows and a negative index
    cases += [
        Case("Gather-embedding-repeated", [node("Gather", ["table", "idx"], axis=0)], {"table": rand(5, 3)},
             lambda t: t["table"][t["idx"]], consts={"idx": indices}),
        Case("Gather-scalar-index", [node("Gather", ["table", "idx"], axis=0)], {"table": rand(5, 3)},
             lambda t: t["table"][2], consts={"idx": i64(2)}),
        Case("GatherElements-axis1-repeated", [node("GatherElements", ["data", "idx"], axis=1)], {"data": rand(3, 4)},
             lambda t: torch.gather(t["data"], 1, t["idx"]), consts={"idx": i64([[0, 0, 3], [1, 2, 1], [3, 3, 3]])}),
        Case("GatherElements-axis0-negative", [node("GatherElements", ["data", "idx"], axis=0)], {"data": rand(3, 4)},
             lambda t: torch.gather(t["data"], 0, t["idx"] % 3), consts={"idx": i64([[-1, 0, 2, 0], [1, -3, 2, 2]])}),
    ]
    return cases


def driver_cases() -> list[Case]:
    """The driver sums the contributions of a value read twice, and of a parameter used by several nodes."""
    return [
        Case("Mul-same-operand-twice", [node("Mul", ["x", "x"])], {"x": rand(3, 4)}, lambda t: t["x"] * t["x"]),
        Case("Add-fan-out-through-two-ops", [node("Tanh", ["x"], ["h"]), node("Sigmoid", ["x"], ["g"]),
                                             node("MatMul", ["h", "w"], ["hw"]), node("Mul", ["hw", "g"])],
             {"x": rand(3, 3), "w": rand(3, 3)}, lambda t: (torch.tanh(t["x"]) @ t["w"]) * torch.sigmoid(t["x"])),
    ]


CASES: list[Case] = (elementwise_cases() + linalg_cases() + pooling_cases() + reduce_cases() + tensor_cases()
                     + driver_cases())


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_gradient_matches_torch(case: Case, tmp_path) -> None:
    check(case, tmp_path)


#: modules with more cases for this harness: (module, its case lists)
CASE_MODULES = {"test_gradient_gather": ("RUN_CASES", "REPEATED_CASES"), "test_gradient_more": ("CASES",),
                "test_gradient_activations": ("CASES",), "test_gradient_resample": ("CASES",),
                "test_lower_composites": ("CASES",), "test_gradient_scatter": ("CASES",)}


def all_cases() -> list[Case]:
    import importlib

    cases = list(CASES)
    for module, lists in CASE_MODULES.items():
        imported = importlib.import_module(f"tests.{module}")
        cases += [case for name in lists for case in getattr(imported, name)]
    return cases


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in all_cases()]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def test_every_supported_op_has_a_case() -> None:
    tested = {n.op_type for c in all_cases() for n in c.nodes} - {"Constant"}
    assert sorted(set(supported_ops()) - tested) == []


def test_op_without_rule_names_op_node_and_supported_ops(tmp_path) -> None:
    case = Case("Cosh-unsupported", [node("Cosh", ["x"], ["h"], name="cosh_on_path"), node("Sin", ["h"])],
                {"x": rand(3, 4)}, lambda t: torch.sin(torch.cosh(t["x"])))
    with pytest.raises(UnsupportedOpError) as raised:
        _step(_model(case, _upstream(case, (3, 4))), tmp_path)
    message = str(raised.value)
    assert "Cosh" in message and "cosh_on_path" in message
    for op_type in supported_ops():
        assert op_type in message


@pytest.mark.parametrize("x_shape", [(2, 3, 4), (1, 3, 4), (2, 2, 3, 4)])
def test_weight_gradient_of_batched_matmul_sums_inside_the_contraction(tmp_path, x_shape) -> None:
    """x [.., M, K] @ W [K, N]: dW is one MatMul over the batch folded into rows, never a [batch, K, N]
    MatMul reduced (or, at batch 1, copied) afterwards."""
    case = Case("MatMul-weight", [node("MatMul", ["x", "w"])], {"w": rand(4, 5)}, lambda t: t["x"] @ t["w"],
                consts={"x": rand(*x_shape)})
    step = onnx.load(_step(_model(case, _upstream(case, (*x_shape[:-1], 5))), tmp_path))
    producers = {out: n.op_type for n in step.graph.node for out in n.output}
    assert not [n.name for n in step.graph.node if n.op_type == "ReduceSum" and producers.get(n.input[0]) == "MatMul"]


def test_global_max_pool_gradient_needs_no_plane_squared_constant(tmp_path) -> None:
    """GlobalMaxPool's gradient routes dY by the argmax with constants of one plane's size (the general
    MaxPool rule's one-hot tap kernels would be C x P^2)."""
    x = rand(2, 3, 16, 16)
    case = Case("GlobalMaxPool-size", [node("GlobalMaxPool", ["x"])], {"x": x},
                lambda t: t["x"].amax(dim=(2, 3), keepdim=True))
    step = onnx.load(_step(_model(case, _upstream(case, (2, 3, 1, 1))), tmp_path))
    sizes = [int(np.prod(t.dims)) for t in step.graph.initializer]
    sizes += [int(np.prod(a.t.dims)) for n in step.graph.node if n.op_type == "Constant" for a in n.attribute
              if a.name == "value"]
    assert max(sizes) <= x.size, f"largest constant {max(sizes)} elements; the input has {x.size}"


def test_training_mode_dropout_is_refused(tmp_path) -> None:
    """A training-mode Dropout drops and rescales: the identity would be a wrong gradient."""
    case = Case("Dropout-training", [node("Dropout", ["x", "ratio", "mode"], ["y", "mask"], name="drop_train")],
                {"x": rand(3, 4)}, lambda t: t["x"], consts={"ratio": f32(0.5), "mode": np.array(True)})
    with pytest.raises(UnsupportedOpError, match="Dropout.*drop_train"):
        _step(_model(case, _upstream(case, (3, 4))), tmp_path)
