"""align_widths: Convs over widths that texels straddle compute whole-texel rows; the model's values are Slice views.

- golden: a 1x1 -> depthwise 3x3 -> 1x1 block at width 15 runs at 16 (op types, pads, shapes, names), the
  depthwise conv reading its input masked to the real columns, the output a Slice view tile_remap reads in place;
- negative: widths of whole texels, widths where a 4th of the work would be extra, implicit padding and an op
  that is not safe on the extra columns (Sqrt) stay as they were;
- numeric: the rewritten graph in onnxruntime equals the original, forward and every gradient of the step
  (build_gradients through the widened graph); MobileNetV2 at [2,3,97,60] (planes 49 x 30, 25 x 15) is checked
  against PyTorch autograd in test_exported_models.py and on PoCL in test_device_models.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fblc.compiler.index_map import IndexMap
from fblc.passes.align_widths import AlignWidths
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes, training_pipeline
from fblc.passes.tile_remap import TileRemap

TOLERANCE = 1e-5  # fp32 both sides: the same products in the same order for every real column


def _block(width: int, channels: int = 8, **depthwise: Any) -> onnx.ModelProto:
    """x -> 1x1 Conv -> Clip -> depthwise 3x3 Conv (pads 1) -> Relu -> 1x1 Conv -> y, at [2, 4, 5, width]."""
    rng = np.random.default_rng(39)
    weights = {"w1": rng.standard_normal((channels, 4, 1, 1)), "w2": rng.standard_normal((channels, 1, 3, 3)),
               "w3": rng.standard_normal((4, channels, 1, 1)), "lo": np.array(0.0), "hi": np.array(6.0)}
    attributes = {"pads": [1, 1, 1, 1], **depthwise}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="expand"),
             helper.make_node("Clip", ["a", "lo", "hi"], ["b"], name="clip"),
             helper.make_node("Conv", ["b", "w2"], ["c"], name="depthwise", group=channels, **attributes),
             helper.make_node("Relu", ["c"], ["d"], name="relu"),
             helper.make_node("Conv", ["d", "w3"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 5, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _aligned(model: onnx.ModelProto) -> tuple[ir.Model, bool]:
    imported = run_passes(ir.from_proto(model), import_passes(TrainingOptions()))
    result = AlignWidths()(imported)
    return result.model, result.modified


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(names, feeds)


def test_golden_a_block_at_width_15_runs_at_16() -> None:
    graph, modified = _aligned(_block(15))
    assert modified
    nodes = list(graph.graph)
    assert [n.op_type for n in nodes] == ["Conv", "Clip", "Mul", "Conv", "Relu", "Conv", "Slice"]
    expand, clip, mask, depthwise, relu, project, output = nodes
    assert [list(n.outputs[0].shape)[-1] for n in nodes] == [16, 16, 16, 16, 16, 16, 15]
    assert mask.inputs[0] is clip.outputs[0] and depthwise.inputs[0] is mask.outputs[0]
    np.testing.assert_array_equal(mask.inputs[1].const_value.numpy(), [1] * 15 + [0])  # its pad's zero
    assert list(depthwise.attributes["pads"].value) == [1, 1, 1, 1]  # 16 columns in, 16 out
    assert project.inputs[0] is relu.outputs[0] and list(project.attributes["pads"].value) == [0, 0, 0, 0]
    assert output.outputs[0].name == "y" and list(output.outputs[0].shape) == [2, 4, 5, 15]
    assert output.outputs[0] in graph.graph.outputs
    TileRemap()(graph)  # the output Slice is a view: rows of 16 cut at 15, read in place
    assert output.metadata_props.get("fblc.remap") == "remapped"


def test_nodes_without_names_get_unique_ones() -> None:
    """Exporters may leave nodes unnamed: the widened nodes' names must still be unique (onnxruntime refuses
    a model with two nodes of one name)."""
    model = _block(15)
    for node in model.graph.node:
        node.name = ""
    graph, modified = _aligned(model)
    names = [n.name for n in graph.graph]
    assert modified and len(set(names)) == len(names), names


@pytest.mark.parametrize("width,attributes", [
    (16, {}),  # whole texels already
    (7, {}),  # 8 columns would add a 7th of the work
    (15, {"auto_pad": "SAME_UPPER", "pads": None}),
])
def test_other_widths_stay(width: int, attributes: dict[str, Any]) -> None:
    depthwise = {k: v for k, v in attributes.items() if v is not None}
    model = _block(width, **depthwise)
    if "pads" in attributes:
        conv = model.graph.node[2]
        conv.attribute.remove(next(a for a in conv.attribute if a.name == "pads"))
    if width == 15:  # the widened 1x1 convs stay; the SAME-padded depthwise conv reads the real columns
        graph, _ = _aligned(model)
        depthwise_conv = next(n for n in graph.graph if n.name.startswith("depthwise"))
        assert depthwise_conv.name == "depthwise" and list(depthwise_conv.outputs[0].shape)[-1] == 15
        return
    graph, modified = _aligned(model)
    assert not modified and [n.op_type for n in graph.graph] == ["Conv", "Clip", "Conv", "Relu", "Conv"]


def test_an_unsafe_op_reads_the_real_columns() -> None:
    """Sqrt of an extra column could be NaN, and NaN times a zero gradient is NaN: it stays narrow."""
    model = _block(15)
    model.graph.node[1].op_type, model.graph.node[1].input[:] = "Sqrt", ["a"]
    graph, modified = _aligned(model)
    assert modified
    sqrt = next(n for n in graph.graph if n.op_type == "Sqrt")
    assert sqrt.inputs[0].producer().op_type == "Slice" and list(sqrt.outputs[0].shape)[-1] == 15


def test_an_input_along_the_width_keeps_the_op_narrow() -> None:
    """A bias of 15 columns broadcast to the map cannot meet 16: the Add reads the real columns."""
    model = _block(15)
    model.graph.node[1].op_type, model.graph.node[1].input[:] = "Add", ["a", "row"]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(15, np.float32), "row"))
    graph, _ = _aligned(model)
    add = next(n for n in graph.graph if n.op_type == "Add")
    assert add.inputs[0].producer().op_type == "Slice" and list(add.outputs[0].shape)[-1] == 15


@pytest.mark.parametrize("strides", [[1, 1], [1, 2]])  # [1, 2]: 15 -> 8 columns, whole already: only reads widen
def test_the_step_equals_the_unaligned_one(strides: list[int]) -> None:
    """Forward and gradients: the extra columns add exactly nothing (their gradients are zero)."""
    model = _block(15, strides=strides)
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((2, 4, 5, 15)).astype(np.float32)}
    aligned_options, plain_options = TrainingOptions(loss="mse"), TrainingOptions(loss="mse", layout="naive")
    steps = {}
    for label, options in (("aligned", aligned_options), ("plain", plain_options)):
        steps[label] = run_passes(ir.from_proto(model), training_pipeline(options))
    widened = [n for n in steps["aligned"].graph if "/wide_" in n.name]
    assert widened and not [n for n in steps["plain"].graph if "/wide_" in n.name]
    step = steps["plain"]
    names = [v.name for v in step.graph.outputs if v.name == "loss" or v.name.endswith(".grad")]
    assert len(names) == 6  # the loss, the three weights and the trained clip bounds
    targets = {v.name: np.ones([int(d) for d in v.shape], np.float32) * 0.5 for v in step.graph.inputs
               if v.name not in feeds and v.name not in {"w1", "w2", "w3", "lo", "hi"} and v.shape is not None}
    inputs = {v.name for v in step.graph.inputs}
    params = {k: onnx.numpy_helper.to_array(t) for k, t in
              ((t.name, t) for t in model.graph.initializer) if k in inputs}
    feed = {**feeds, **targets, **params}
    got = _run(ir.to_proto(steps["aligned"]), feed, names)
    want = _run(ir.to_proto(step), feed, names)
    for name, a, b in zip(names, got, want):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE, err_msg=name)


def test_rows_cut_short_keep_whole_texels() -> None:
    """tile_remap's tile boundary check: a view of rows of 16 cut at 15 keeps each texel a run of its row, one
    starting off a texel or with rows closer than their length does not."""
    assert IndexMap((2, 3, 15), (48, 16, 1)).packs_whole_texels((2, 3, 16))
    assert not IndexMap((2, 3, 15), (48, 16, 1), offset=1).packs_whole_texels((2, 3, 16))
    assert not IndexMap((2, 3, 15), (42, 14, 1)).packs_whole_texels((2, 3, 14))
    assert not IndexMap((2, 3, 15), (48, 12, 1)).packs_whole_texels((2, 4, 12))


@pytest.mark.parametrize("adapter", ["memflora", "memflora-sg"])
def test_adapter_projections_stay_narrow_and_every_site_trains(adapter: str) -> None:
    """An adapter's q = P x keeps the model's width (15) where its site's convs run at 16: the backward saves r x H x
    W x B values, not W rounded up, and memflora-sg, which finds q by its tag, trains P at every site (a widened q
    lost the tag, and its site's P its gradient); the aligned step equals the unaligned one in onnxruntime."""
    from fblc.compiler import keys
    from fblc.compiler.adapters import AdapterConfig

    model = _block(15)
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal((2, 4, 5, 15)).astype(np.float32)}
    steps = {}
    for label, layout in (("aligned", "rtile"), ("plain", "naive")):
        options = TrainingOptions(loss="mse", layout=layout, adapter=AdapterConfig(adapter, rank=2))
        steps[label] = run_passes(ir.from_proto(model), training_pipeline(options))
    aligned = steps["aligned"]
    assert [n for n in aligned.graph if "/wide_" in n.name]
    qs = [v for n in aligned.graph for v in n.outputs if v is not None and keys.ADAPTER_SITE_Q in v.metadata_props]
    assert len(qs) == 2 and all(list(q.shape) == [2, 2, 5, 15] for q in qs)  # expand's and project's, narrow
    names = [v.name for v in steps["plain"].graph.outputs if v.name == "loss" or v.name.endswith(".grad")]
    assert sorted(n for n in names if "adapter_P" in n) == (
        sorted(f"{site}.adapter_P.grad" for site in ("w1", "w3")) if adapter == "memflora-sg" else [])
    assert {v.name for v in aligned.graph.outputs} >= set(names)
    feed = dict(feeds)
    for step in steps.values():
        for value in step.graph.inputs:
            if value.name not in feed and value.shape is not None:
                source = step.graph.initializers.get(value.name)
                shape = [int(d) for d in value.shape]
                if "adapter_U" in value.name:  # nonzero, so that q's gradient (U^T dL/dz) and P's are
                    feed[value.name] = rng.standard_normal(shape).astype(np.float32)
                elif source is not None and source.const_value is not None:
                    feed[value.name] = source.const_value.numpy()
                else:
                    feed[value.name] = np.full(shape, 0.5, np.float32)
    for name, a, b in zip(names, _run(ir.to_proto(aligned), feed, names), _run(ir.to_proto(steps["plain"]), feed, names)):
        assert name == "loss" or "adapter" not in name or np.abs(b).max() > 1e-3, name  # a gradient that can differ
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE, err_msg=name)
