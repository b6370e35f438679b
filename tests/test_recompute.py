"""recompute: checkpointing by --device-memory, on a residual MLP of three blocks (x + W2 relu(W1 x)).

The step with a budget must give the gradients of the step without one (onnxruntime, both step graphs);
the lowered plan's live peak must drop under the budget; a budget under the floor must fail naming it.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.compiler.keys import RECOMPUTE
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.errors import FblcError
from fblc.passes.memory_plan import check_budget, plan_memory
from fblc.passes.pipeline import TrainingOptions, build_training_graph
from fblc.passes.recompute import find_layers
from fblc.profiles import load_profile

B, T, D, H, V, BLOCKS = 2, 64, 16, 64, 10, 3


def _residual_mlp(path: str) -> None:
    rng = np.random.default_rng(5)
    nodes, weights, x = [], {}, "x"
    for i in range(BLOCKS):
        weights[f"w1_{i}"] = (rng.normal(size=(D, H)) / 4).astype(np.float32)
        weights[f"w2_{i}"] = (rng.normal(size=(H, D)) / 8).astype(np.float32)
        nodes += [helper.make_node("MatMul", [x, f"w1_{i}"], [f"h{i}"], name=f"up{i}"),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("MatMul", [f"r{i}", f"w2_{i}"], [f"d{i}"], name=f"down{i}"),
                  helper.make_node("Add", [x, f"d{i}"], [f"x{i}"], name=f"res{i}")]
        x = f"x{i}"
    weights["head"] = rng.normal(size=(D, V)).astype(np.float32)
    nodes.append(helper.make_node("MatMul", [x, "head"], ["logits"], name="head"))
    graph = helper.make_graph(nodes, "resmlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, T, D])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [B, T, V])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path)


def _options(budget: int) -> TrainingOptions:
    return TrainingOptions(device_memory=budget, optimizer=OptimizerConfig(name="sgd", lr=0.0))


@pytest.fixture(scope="module")
def resmlp(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("resmlp") / "resmlp.onnx")
    _residual_mlp(path)
    return path


def test_layers_are_the_blocks_between_residual_cuts(resmlp) -> None:
    step = build_training_graph(load_model(resmlp), _options(0))
    layers = find_layers(step.graph)
    # each block's up/relu/down makes what its backward reads; the residual Add's output is the cut
    assert [(lay.nodes[0].name, lay.nodes[-1].name) for lay in layers][:BLOCKS] == \
        [(f"up{i}", f"res{i}") for i in range(BLOCKS)]
    assert all(lay.saved_bytes > 0 and lay.flops > 0 for lay in layers)


def test_recomputed_step_gives_the_same_gradients_and_fits(resmlp, tmp_path) -> None:
    x = np.random.default_rng(1).normal(size=(B, T, D)).astype(np.float32)
    labels = np.random.default_rng(2).integers(0, V, size=(B, T)).astype(np.int64)
    results, peaks = {}, {}
    profile = load_profile("adreno830")
    budget = 0
    for case in ("plain", "budget"):
        options = _options(budget)
        step = build_training_graph(load_model(resmlp), options)
        save_model_atomically(step, str(tmp_path / f"{case}.onnx"))
        session = ort.InferenceSession(str(tmp_path / f"{case}.onnx"), providers=["CPUExecutionProvider"])
        results[case] = dict(zip([o.name for o in session.get_outputs()],
                                 session.run(None, {"x": x, "labels": labels})))
        peaks[case] = plan_memory(build_training_graph(load_model(resmlp), options, lower=profile)).summary()
        budget = int(peaks["plain"]["live_peak"] * 0.9)  # all three blocks recomputed: 0.87x
    recomputed = peaks["budget"]["recompute"]
    assert recomputed["layers"] and recomputed["flops_added"] > 0 and recomputed["budget"] == budget
    assert peaks["budget"]["live_peak"] <= budget < peaks["plain"]["live_peak"]
    assert peaks["budget"]["saved"] < peaks["plain"]["saved"]
    for name, value in results["plain"].items():
        np.testing.assert_array_equal(results["budget"][name], value, err_msg=name)


def test_a_budget_under_the_floor_is_refused_naming_it(resmlp) -> None:
    step = build_training_graph(load_model(resmlp), _options(10_000))
    recomputed = json.loads(step.metadata_props[RECOMPUTE])
    assert recomputed["estimate_after"] > 10_000 and len(recomputed["layers"]) == BLOCKS  # all it could
    plan = plan_memory(step)
    with pytest.raises(FblcError, match=r"over --device-memory 0.01 MB: that is the floor with 3 layers recomputed"):
        check_budget(plan, 10_000)
    assert RECOMPUTE not in build_training_graph(load_model(resmlp), _options(0)).metadata_props  # no budget, no pass


def test_a_bundle_over_the_budget_is_built_again_recomputing_more(resmlp, monkeypatch) -> None:
    """Recompute stops where its node-order estimate fits; where the bundle then allocates more than the budget
    and layers are left, fblc compile builds the step again aiming lower by the overshoot. The first check is
    made to report an overshoot of 6 % of the plain step's allocation (recompute's estimate and the bundle
    disagree by that much at 1B widths); the second build recomputes every block and fits."""
    import fblc.codegen.compile as compile_module
    from fblc.passes.memory_plan import OverBudgetError

    profile = load_profile("adreno830")
    _, _, plain, _ = compile_module.build_program(resmlp, _options(0), profile, {})
    budget, overshoot = int(plain.allocated_bytes * 0.99), int(plain.allocated_bytes * 0.06)
    targets: list[int] = []
    real_build, real_check = compile_module.build_training_graph, compile_module.check_budget

    def build(model, options, **kwargs):  # type: ignore[no-untyped-def]
        targets.append(options.recompute_target)
        return real_build(model, options, **kwargs)

    def check(plan, budget_bytes, allocated, forward=False):  # type: ignore[no-untyped-def]
        if len(targets) == 1:
            raise OverBudgetError("over", "", budget_bytes + overshoot, budget_bytes, layers_left=1)
        real_check(plan, budget_bytes, allocated, forward)

    monkeypatch.setattr(compile_module, "build_training_graph", build)
    monkeypatch.setattr(compile_module, "check_budget", check)
    _, _, table, plan = compile_module.build_program(resmlp, _options(budget), profile, {})
    assert targets == [0, budget - overshoot]
    assert len(plan.recompute["layers"]) == BLOCKS and plan.recompute["budget"] == budget - overshoot
    assert table.allocated_bytes <= budget
