"""Folded views: a reshape that merges axes that are not contiguous in their root (heads merged after
a transpose) is a view whose merged axis is a mixed-radix number of digits, not a copy kernel.

Golden: the maps of composed views equal numpy's element order, and the merge of an attention's
heads is remapped. Negative: a reader that cannot walk digits (Gemm) and a MatMul whose two
K axes fold into digits that do not nest keep their copy. Numeric: the step of a folded attention
projection on PoCL equals onnxruntime's, on the texel path with register tiles, on the per-lane
path, with digits that are no power of two, and read by a ReduceSum."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fblc.compiler import keys
from fblc.compiler.index_map import IndexMap, common_digits
from fblc.compiler.model_io import load_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.profiles import load_profile
from fblc.tools.verify import verify_model
from tests.conftest import make_model

OPTIONS = TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1))


def _elements(index_map: IndexMap) -> np.ndarray:
    """The root element each view element reads, digit by digit (independent of the codegen's C)."""
    out = np.zeros(index_map.shape, dtype=np.int64)
    for index in np.ndindex(*index_map.shape):
        flat = index_map.offset
        for axis, i in enumerate(index):
            for extent, stride in reversed(index_map.sub_axes(axis)):
                flat, i = flat + (i % extent) * stride, i // extent
        out[index] = flat
    return out


def test_composed_maps_read_numpys_elements() -> None:
    rng = np.random.default_rng(7)
    folded = 0
    for _ in range(200):
        shape = tuple(int(d) for d in rng.choice([1, 2, 3, 4, 6], rng.integers(1, 5)))
        array = np.arange(int(np.prod(shape))).reshape(shape)
        index_map = IndexMap.identity(shape)
        for _ in range(5):
            kind = rng.integers(0, 3)
            if kind == 0:
                perm = list(rng.permutation(array.ndim))
                index_map, array = index_map.transposed(perm), array.transpose(perm)
            elif kind == 1:
                dims, rest = [], array.size
                while rest > 1:
                    dims.append(int(rng.choice([d for d in range(2, rest + 1) if rest % d == 0])))
                    rest //= dims[-1]
                reshaped = index_map.reshaped(tuple(dims))
                if reshaped is not None:
                    index_map, array = reshaped, array.reshape(dims)
            else:
                starts = [int(rng.integers(0, d)) for d in array.shape]
                sliced = index_map.sliced(starts, [1] * array.ndim, tuple(d - s for d, s in zip(array.shape, starts)))
                if sliced is not None:
                    index_map, array = sliced, array[tuple(slice(s, None) for s in starts)]
        folded += index_map.folded
        np.testing.assert_array_equal(_elements(index_map), array)
        assert IndexMap.from_json(index_map.to_json()) == index_map
    assert folded > 20  # the walk reached folded maps, not only plain strides


def test_common_digits_split_each_operand_where_the_other_is_cut() -> None:
    assert common_digits([[(4, 2048), (16, 1)], [(64, 64)]]) == [[(4, 2048), (16, 1)], [(4, 1024), (16, 64)]]
    assert common_digits([[(2, 100), (8, 1)], [(4, 50), (4, 1)]]) == [[(2, 100), (2, 4), (4, 1)],
                                                                    [(2, 100), (2, 50), (4, 1)]]
    assert common_digits([[(3, 100), (4, 1)], [(2, 50), (6, 1)]]) is None  # cuts at 4 and 6 of 12 do not nest


def _heads_proto(heads: int, dim: int, features: int, batch: int = 2, seq: int = 8) -> onnx.ModelProto:
    """x -> Wv -> split heads -> (* per-head scale) -> merge heads -> Wo -> mean, plus the mean square of the
    merge plus a bias: the merge is a folded view that a MatMul and an Add read."""
    rng = np.random.default_rng(heads * 100 + dim)
    width = heads * dim
    inits = {"w_in": (rng.standard_normal((8, width)) / 3).astype(np.float32),
             "scale": rng.standard_normal((1, heads, 1, dim)).astype(np.float32),
             "w_out": (rng.standard_normal((width, features)) / 3).astype(np.float32),
             "bias": rng.standard_normal(width).astype(np.float32),
             "split_shape": np.array([batch, seq, heads, dim], dtype=np.int64),
             "merge_shape": np.array([batch, seq, width], dtype=np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "w_in"], ["v"], name="proj_in"),
             helper.make_node("Reshape", ["v", "split_shape"], ["v_split"], name="split"),
             helper.make_node("Transpose", ["v_split"], ["v_heads"], perm=[0, 2, 1, 3], name="heads"),
             helper.make_node("Mul", ["v_heads", "scale"], ["context"], name="scaled"),
             helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3], name="unheads"),
             helper.make_node("Reshape", ["context_t", "merge_shape"], ["merged"], name="merge"),
             helper.make_node("MatMul", ["merged", "w_out"], ["out"], name="proj_out"),
             helper.make_node("ReduceMean", ["out"], ["out_mean"], keepdims=0, name="mean"),
             # an elementwise reader of the folded view, its lanes one texel of it
             helper.make_node("Add", ["merged", "bias"], ["shifted"], name="shift"),
             helper.make_node("Mul", ["shifted", "shifted"], ["squares"], name="square"),
             helper.make_node("ReduceMean", ["squares"], ["square_mean"], keepdims=0, name="square_mean"),
             helper.make_node("Add", ["out_mean", "square_mean"], ["loss_value"], name="loss")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, 8])],
                      [helper.make_tensor_value_info("loss_value", TensorProto.FLOAT, [])], inits)


def _statuses(path: str) -> dict[str, str]:
    step = build_training_graph(load_model(path), OPTIONS, lower=load_profile("local"))
    return {n.name: n.metadata_props.get(keys.REMAP, "") for n in step.graph
            if n.op_type == "Reshape" and (keys.INDEX_MAP in n.metadata_props or keys.REMAP in n.metadata_props)}


# (heads, head dim, features): register tiles of 8 x 8; output columns of 6, per lane, whose
# backward also reads heads of 4 in tiles of 4 rows; digits of 3 and 12 (a division, no shift)
@pytest.mark.parametrize("heads,dim,features", [(4, 8, 8), (2, 4, 6), (3, 12, 4)])
def test_folded_merge_step_matches_onnxruntime(tmp_path, heads: int, dim: int, features: int) -> None:
    path = str(tmp_path / "heads.onnx")
    onnx.save(_heads_proto(heads, dim, features), path)
    statuses = _statuses(path)
    assert statuses["merge"] == "remapped"
    assert sum(status == "remapped" for status in statuses.values()) >= 3  # the gradient's merges fold too
    rows = verify_model(path, OPTIONS)
    assert rows and not [r.name for r in rows if not r.ok]


def _merged_heads_proto(reader: onnx.NodeProto, reader_inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    """p[2, 4, 8, 8] * x -> heads merged ([2, 8, 32], or [16, 32] for a Gemm) -> `reader` -> mean."""
    rng = np.random.default_rng(1)
    merged = [16, 32] if reader.op_type == "Gemm" else [2, 8, 32]
    nodes = [helper.make_node("Mul", ["x", "p"], ["y"], name="scaled"),
             helper.make_node("Transpose", ["y"], ["y_t"], perm=[0, 2, 1, 3], name="unheads"),
             helper.make_node("Reshape", ["y_t", "merge_shape"], ["merged"], name="merge"), reader,
             helper.make_node("ReduceMean", ["read"], ["loss_value"], keepdims=0, name="mean")]
    inits = {"p": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
             "merge_shape": np.array(merged, dtype=np.int64), **reader_inits}
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 8])],
                      [helper.make_tensor_value_info("loss_value", TensorProto.FLOAT, [])], inits)


def test_a_reduction_reads_a_folded_view(tmp_path) -> None:
    """A bias gradient's kind of reader: ReduceSum over the merged rows reads the folded view element by element."""
    reader = helper.make_node("ReduceSum", ["merged", "axes"], ["read"], keepdims=0, name="row_sums")
    path = str(tmp_path / "sums.onnx")
    onnx.save(_merged_heads_proto(reader, {"axes": np.array([0, 1], dtype=np.int64)}), path)
    assert _statuses(path)["merge"] == "remapped"
    rows = verify_model(path, OPTIONS)
    assert rows and not [r.name for r in rows if not r.ok]


def test_a_reader_without_digits_keeps_the_copy(tmp_path) -> None:
    """Gemm reads its operands by two strides: B x T merged after the transpose is no such axis."""
    weight = np.random.default_rng(3).standard_normal((32, 5)).astype(np.float32)
    reader = helper.make_node("Gemm", ["merged", "w"], ["read"], name="dense")
    path = str(tmp_path / "gemm.onnx")
    onnx.save(_merged_heads_proto(reader, {"w": weight}), path)
    assert _statuses(path)["merge"] == "kept: read by Gemm, whose kernel cannot read folded axes"


def test_a_matmul_whose_k_digits_do_not_nest_keeps_one_copy(tmp_path) -> None:
    """A's K of 48 folds 3 x 16, W's 4 x 12: no loop nest walks both, so the later merge stays a copy."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Transpose", ["x"], ["x_t"], perm=[0, 2, 1, 3], name="x_heads"),
             helper.make_node("Reshape", ["x_t", "a_shape"], ["a"], name="merge_a"),
             helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0, 2], name="w_swap"),
             helper.make_node("Reshape", ["w_t", "w_shape"], ["w_k"], name="merge_w"),
             helper.make_node("MatMul", ["a", "w_k"], ["out"], name="proj"),
             helper.make_node("ReduceMean", ["out"], ["loss_value"], keepdims=0, name="mean")]
    inits = {"w": rng.standard_normal((12, 4, 8)).astype(np.float32),
             "a_shape": np.array([2, 8, 48], dtype=np.int64), "w_shape": np.array([48, 8], dtype=np.int64)}
    path = str(tmp_path / "nest.onnx")
    onnx.save(make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 16])],
                         [helper.make_tensor_value_info("loss_value", TensorProto.FLOAT, [])], inits), path)
    statuses = _statuses(path)
    assert sorted(statuses[name] for name in ("merge_a", "merge_w")) == [
        "kept: a MatMul's K axis folds differently in its two operands", "remapped"]
    rows = verify_model(path, OPTIONS)
    assert rows and not [r.name for r in rows if not r.ok]
