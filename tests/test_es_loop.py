"""ES members in a loop (fblc.compiler.es_loop, pass es_loop): the kernel plan holds one member forward that both
runtimes repeat 2P times, so the plan does not grow with the pairs; the textures the body reads live through
every repetition; the phases keep the order topological. The numbers are tested against the unrolled ONNX step
in test_fura_s_es.py (LocalRunner) and test_native_runner.py (the C runner against LocalRunner)."""

from __future__ import annotations

import json
import os
import sys

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from fblc.codegen.compile import compile_model
from fblc.codegen.plan import Loop, through_loops
from fblc.compiler import keys
from fblc.compiler.adapters import AdapterConfig
from fblc.compiler.es import EsConfig
from fblc.compiler.es_loop import AFTER, BEFORE, BODY
from fblc.compiler.model_io import load_model
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.es_loop import EsLoop
from fblc.passes.pipeline import TrainingOptions, build_training_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from mlp import build_mlp  # noqa: E402


def _compiled(path: str, out: str, pairs: int) -> tuple[dict, dict]:
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=8), trainer="es",
                              es=EsConfig(pairs=pairs, sigma=0.05), optimizer=OptimizerConfig("sgd", lr=1.0))
    _, report = compile_model(path, out, "adreno830", "fp32", options)
    with open(os.path.join(out, "plan.json"), encoding="utf-8") as handle:
        return json.load(handle), report


def test_the_kernel_plan_does_not_grow_with_the_pairs_and_the_body_reads_what_lives_through_it(tmp_path) -> None:
    path = build_mlp(str(tmp_path / "mlp.onnx"), batch=8, in_features=16, hidden=(16,), classes=5)
    two, two_report = _compiled(path, str(tmp_path / "p2"), 2)
    five, five_report = _compiled(path, str(tmp_path / "p5"), 5)
    [(two_loop, five_loop)] = zip(two["loops"], five["loops"])
    assert ([k["name"] for k in two["kernels"][two_loop["begin"]:two_loop["end"]]]
            == [k["name"] for k in five["kernels"][five_loop["begin"]:five_loop["end"]]])
    assert abs(len(two["kernels"]) - len(five["kernels"])) <= 2  # the z-scores' slices of 2P rewards may differ
    for plan, report, pairs in ((two, two_report, 2), (five, five_report, 5)):
        [loop] = plan["loops"]
        body = loop["end"] - loop["begin"]
        assert loop["count"] == 2 * pairs and 0 < loop["begin"] < loop["end"] < len(plan["kernels"])
        assert report["launches_per_step"] == len(plan["kernels"]) + (2 * pairs - 1) * body
        names = {plan["textures"][t]["name"] for pair in loop["swaps"] for t in pair}
        assert names == {"es.member", "es.member.next", "es.rewards", "es.rewards.next"}
        lifetimes = [t["lifetime"] for t in plan["textures"]]
        read_in_body = {t for k in plan["kernels"][loop["begin"]:loop["end"]] for t in k["inputs"]}
        for texture in read_in_body:  # made before the loop: it must outlive the last repetition
            first, last = lifetimes[texture]
            assert first >= loop["begin"] or last >= loop["end"] - 1, plan["textures"][texture]["name"]
        for image in plan["images"]:  # textures sharing an image never live at once
            spans = sorted(lifetimes[t] for t in image["textures"])
            assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), image
    # the ONNX step onnxruntime checks stays unrolled: a copy per member
    options = TrainingOptions(adapter=AdapterConfig(kind="fura-s", block=8), trainer="es", es=EsConfig(pairs=5))
    step = build_training_graph(load_model(path), options)
    assert any(n.name.startswith("es/member_10/") for n in step.graph)


def test_a_texture_the_body_reads_lives_through_every_repetition() -> None:
    loops = [Loop(begin=3, end=7, count=4, swaps=())]
    # made before, last read in the body -> to the loop's end; inside, after, before only, never used: as they were
    assert through_loops([(1, 4), (4, 5), (8, 9), (0, 2), (-1, -1), (2, 9)], loops) == [
        (1, 6), (4, 5), (8, 9), (0, 2), (-1, -1), (2, 9)]


def _phased(*extra: onnx.NodeProto) -> ir.Model:
    """x carried to x.next by the body (y = x + b, x.next = y * b), b = relu(w) before it, z = -x after it."""
    nodes = [helper.make_node("Neg", ["x"], ["z"], name="after"), helper.make_node("Relu", ["w"], ["b"], name="before"),
             helper.make_node("Add", ["x", "b"], ["y"], name="body_add"),
             helper.make_node("Mul", ["y", "b"], ["x.next"], name="body_mul"), *extra]
    outputs = ["z", "x.next"] + [o for n in extra for o in n.output]
    graph = helper.make_graph(nodes, "phases", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4])
                                                for n in ("x", "w")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in outputs])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    model.graph.inputs[0].metadata_props[keys.LOOP_CARRIED] = "x.next"
    return model


def test_es_loop_orders_before_body_after_and_refuses_a_reader_of_the_body_after_the_loop() -> None:
    model = _phased()
    assert EsLoop().call(model).modified
    assert [(n.name, n.metadata_props[keys.LOOP_PHASE]) for n in model.graph] == [
        ("before", BEFORE), ("body_add", BODY), ("body_mul", BODY), ("after", AFTER)]
    unlooped = _phased()
    del unlooped.graph.inputs[0].metadata_props[keys.LOOP_CARRIED]
    assert not EsLoop().call(unlooped).modified
    with pytest.raises(AssertionError, match="'late' runs after the loop but reads 'y' of its body"):
        EsLoop().call(_phased(helper.make_node("Sub", ["y", "w"], ["late_out"], name="late")))
