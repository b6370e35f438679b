"""Texel-wide lanes (fblc/codegen/texel_wide.py): a contraction's epilogue computed as float4s where every
lane is the same arithmetic, per lane where it is not; the step equals onnxruntime's either way."""

from __future__ import annotations

import math
import os
import shutil

import pytest

from fblc.codegen import ir as kir
from fblc.codegen.compile import compile_model
from fblc.codegen.texel_wide import vectorize
from tests.support.kernel_ir import expressions, lowered_kernels, of_type
from tests.test_half_arithmetic import CLANG, _clang_errors
from tests.test_kernels_contraction import OPTIONS, _node, assert_step_matches, write_case

# exact GELU as exporters write it: x * 0.5 * (1 + erf(x / sqrt(2))), after a MatMul and its bias
GELU = [_node("MatMul", ["a", "b"], "m"), _node("Add", ["m", "c"], "x"),
        _node("Div", ["x", "root2"], "d"), _node("Erf", ["d"], "e"), _node("Add", ["e", "one"], "e1"),
        _node("Mul", ["x", "e1"], "p"), _node("Mul", ["p", "half"], "y")]


def _gelu_case(tmp_path, inputs: dict) -> str:
    import numpy as np

    scalars = {"root2": np.array(math.sqrt(2.0), np.float32), "one": np.array(1.0, np.float32),
               "half": np.array(0.5, np.float32)}
    return write_case(str(tmp_path / "gelu.onnx"), GELU, {**inputs, **scalars})


def _forward(path: str, target: str = "local", dtype: str = "fp32"):  # the MatMul with its GELU epilogue
    kernels = lowered_kernels(path, target, dtype, OPTIONS)
    return next(k for k in kernels if k.family == "matmul" and not k.nodes[0].startswith("grad/"))


def _lane_loops(kernel) -> list[kir.For]:
    return [loop for loop in of_type(kernel, kir.For) if loop.var.name == "lane"]


def test_a_gelu_epilogue_is_computed_on_float4s(tmp_path) -> None:
    """The MatMul's tile (8 x 8 outputs) runs its bias, erf and products as float4s: no lane loop, the
    preamble's erf_rational4; the trained step equals onnxruntime's in buffer storage (image storage: the
    zoo's BERT, GPT-2 and ViT in test_device_models)."""
    path = _gelu_case(tmp_path, {"a": (8, 16), "b": (16, 8), "c": (8,)})
    kernel = _forward(path)
    calls = {e.function for e in expressions(kernel) if isinstance(e, kir.Call)}
    assert not _lane_loops(kernel) and "erf_rational4" in calls and "erf_rational" not in calls
    assert_step_matches(path, storage="buffer")


def test_a_half_kernels_float4_epilogue_builds_in_clang(tmp_path) -> None:
    """Under --dtype fp16 on adreno830 the float4 epilogue is retyped to real4 like any other (precision.py):
    both sources type-check in clang-15 with cl_khr_fp16 and without it."""
    if shutil.which(CLANG) is None:
        pytest.skip(f"{CLANG} is missing: the half source is not type-checked")
    path = _gelu_case(tmp_path, {"a": (8, 16), "b": (16, 8), "c": (8,)})
    assert not _lane_loops(_forward(path, "adreno830", "fp16"))
    bundle = str(tmp_path / "bundle")
    compile_model(path, bundle, "adreno830", "fp16", OPTIONS)
    for source in ("kernels.cl", "kernels.buffer.cl"):
        text = open(os.path.join(bundle, source)).read()
        assert "typedef half real;" in text and "erf_rational4(" in text
        for fp16 in (True, False):
            assert not _clang_errors(os.path.join(bundle, source), fp16)


def test_a_lanes_own_index_leaves_the_loop_per_lane() -> None:
    """An integer that varies by lane (a lane's own index) has no float4 form: vectorize answers None."""
    numbering = kir.Numbering()
    block = kir.Block(numbering)
    lane = kir.Var("lane", 0, kir.INT, "lane")
    flat = block.let(lane * 3, "i")
    value = kir.Cast(kir.FLOAT, flat) * 2.0
    assert vectorize(lane, block.statements, [value], kir.Block(numbering)) is None
    # an emitter's own Var of a lane index's fixed name (o3) is that index too: a per-lane read stays per lane
    header = kir.Block(numbering)
    header.add(kir.Declare(kir.Var("o3", 0, kir.INT, "o3"), lane + 1))
    read = kir.Lane(kir.Load(kir.Argument("in", 0, "float", "float4", None), kir.Var("o", 3, kir.INT, "o3") >> 2), lane)
    assert vectorize(lane, header.statements, [read * 2.0], kir.Block(numbering)) is None
    scaled = kir.Element(kir.Var("acc", 1, kir.FLOAT), lane) * 2.0  # an array's lane: its float4 form
    assert vectorize(lane, [], [scaled], kir.Block(numbering)) is not None


# a lane-varying select and its saved mask: Where(x > c, exp(x), x / 2) between two MatMuls (a half kernel under
# fp16: it reads and writes activations), whose backward reads the comparison's bits
SELECT = [_node("MatMul", ["a", "b"], "x"), _node("Greater", ["x", "c"], "g"), _node("Exp", ["x"], "e"),
          _node("Mul", ["x", "half"], "h"), _node("Where", ["g", "e", "h"], "w"), _node("MatMul", ["w", "d"], "y")]


def _select_case(tmp_path) -> str:
    import numpy as np

    return write_case(str(tmp_path / "select.onnx"), SELECT, {"a": (4, 8), "b": (8, 8), "c": (8,), "d": (8, 4),
                                                                 "half": np.array(0.5, np.float32)})


def _select_kernel(path: str, target: str = "local", dtype: str = "fp32"):
    kernels = lowered_kernels(path, target, dtype, OPTIONS)
    return next(k for k in kernels if any(isinstance(e, kir.Binary) and e.op == ">" for e in expressions(k)))


def test_a_comparison_mask_and_select_are_computed_on_float4s(tmp_path) -> None:
    """The forward kernel's comparison is one int4, its Where a float4 select and its saved mask's bits the
    int4's lanes: no lane loop; the trained step (the backward reads the mask) equals onnxruntime's."""
    path = _select_case(tmp_path)
    kernel = _select_kernel(path)
    compared = [e for e in expressions(kernel) if isinstance(e, kir.Binary) and e.op == ">"]
    assert not _lane_loops(kernel) and compared and all(e.dtype == kir.INT4 for e in compared)
    assert_step_matches(path, storage="buffer")


def test_a_half_kernels_float4_select_builds_in_clang(tmp_path) -> None:
    """Under --dtype fp16 on adreno830 the int4 condition selects between float4s (precision.py), never half4s:
    both sources type-check in clang-15 with cl_khr_fp16 and without it."""
    if shutil.which(CLANG) is None:
        pytest.skip(f"{CLANG} is missing: the half source is not type-checked")
    path = _select_case(tmp_path)
    assert not _lane_loops(_select_kernel(path, "adreno830", "fp16"))
    bundle = str(tmp_path / "bundle")
    compile_model(path, bundle, "adreno830", "fp16", OPTIONS)
    for source in ("kernels.cl", "kernels.buffer.cl"):
        for fp16 in (True, False):
            assert not _clang_errors(os.path.join(bundle, source), fp16)


def test_a_comparison_in_arithmetic_leaves_the_loop_per_lane() -> None:
    """A float4 comparison is -1 where a scalar one is 1: one that arithmetic meets stays per lane."""
    numbering = kir.Numbering()
    lane = kir.Var("lane", 0, kir.INT, "lane")
    x = kir.Element(kir.Var("acc", 1, kir.FLOAT), lane)
    compared = x.gt(kir.const(0.0, kir.FLOAT))
    assert vectorize(lane, [], [kir.select(compared, x, 0.0)], kir.Block(numbering)) is not None
    assert vectorize(lane, [], [kir.Cast(kir.FLOAT, compared) * x], kir.Block(numbering)) is None


def test_a_lanes_comparison_with_a_shared_integer_is_an_int4_condition() -> None:
    """Where a texel crosses the end of a row of N % 4 != 0 elements (Softmax over 65 tokens), a lane takes its
    row's value or the next row's by `lane < n`: the lanes' indices (int4)(0, 1, 2, 3) compared with n in every
    lane, an int4 that selects between float4s. Negative: a comparison of a lane-varying integer other than the
    lane itself (o3, its own index) stays per lane."""
    numbering = kir.Numbering()
    lane = kir.Var("lane", 0, kir.INT, "lane")
    n = kir.Var("n", 7, kir.INT)
    x = kir.Element(kir.Var("acc", 1, kir.FLOAT), lane)
    wide = kir.Block(numbering)
    vectors = vectorize(lane, [], [kir.select(lane.lt(n), x, x * 2.0)], wide)
    assert vectors is not None and isinstance(vectors[0], kir.Select) and vectors[0].condition.dtype == kir.INT4
    assert vectors[0].condition.a == kir.Vector(kir.INT4, tuple(kir.const(k) for k in range(4)))
    header = kir.Block(numbering)
    index = header.let(lane + 1, "o")
    assert vectorize(lane, header.statements, [kir.select(index.lt(n), x, x * 2.0)], kir.Block(numbering)) is None
