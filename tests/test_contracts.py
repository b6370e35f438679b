"""Pass contracts (fblc/passes/contracts.py): what each pass requires and ensures, checked as it runs.

Golden: the whole compile pipeline is in a valid order and every pass declares its facts.
Negative: a pass run out of order, a pipeline put out of order, a pass that breaks its promise,
each stops with the pass and the fact named. Numeric: the pipeline under onnx_ir's PassManager
builds the same step (onnxruntime runs it), and a user error inside a pass reaches the caller
as itself, not wrapped.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from fblc.compiler import keys
from fblc.compiler.model_io import load_model
from fblc.compiler.reference import ReferenceStep
from fblc.errors import TrainableSetError
from fblc.passes.attach_loss import AttachLoss
from fblc.passes.build_gradients import BuildGradients
from fblc.passes.contracts import FACTS, ContractPass, check_order
from fblc.passes.fuse import FuseKernels
from fblc.passes.memory_plan import MemoryPlanPass
from fblc.passes.optimizer_step import OptimizerStep
from fblc.passes.pipeline import (TrainingOptions, build_training_graph, compile_pipeline, import_passes,
                                  run_passes)
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.rtile_select import RTileSelect
from fblc.passes.storage_precision import StoragePrecision
from fblc.passes.tile_remap import TileRemap
from fblc.profiles import load_profile


def test_compile_pipeline_order_is_valid_and_every_fact_is_known() -> None:
    passes = compile_pipeline(TrainingOptions(), load_profile("adreno830"))
    check_order(passes)
    for graph_pass in passes:
        assert isinstance(graph_pass, ContractPass), f"{graph_pass.name} declares no contract"
        for fact in graph_pass.requires_facts + graph_pass.ensures_facts:
            assert fact in FACTS, f"{graph_pass.name}: unknown fact '{fact}'"
    ensured = {f for p in passes for f in p.ensures_facts}
    assert ensured == set(FACTS), f"facts no pass ensures: {set(FACTS) - ensured}"


def test_a_pipeline_out_of_order_is_refused_before_it_runs() -> None:
    passes = compile_pipeline(TrainingOptions(), load_profile("adreno830"))
    swapped = [p for p in passes if not isinstance(p, BuildGradients)]
    swapped.insert(next(i for i, p in enumerate(swapped) if isinstance(p, OptimizerStep)) + 1, BuildGradients())
    with pytest.raises(ir.passes.PreconditionError, match="'optimizer_step' requires 'gradients'.*build_gradients"):
        check_order(swapped)


def test_a_pass_run_out_of_order_names_the_pass_and_the_fact(mlp_path: str) -> None:
    model = run_passes(load_model(mlp_path), import_passes(TrainingOptions()))
    with pytest.raises(ir.passes.PreconditionError) as raised:
        run_passes(model, [BuildGradients()])
    message = str(raised.value)
    assert "'build_gradients' requires 'trainable inputs'" in message and "run mark_trainable before it" in message


class _DropsShapes(ContractPass):
    """Promises static shapes and breaks the promise: forgets the first node's output shape."""

    name = "drops_shapes"
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        next(iter(model.graph)).outputs[0].shape = None
        return ir.passes.PassResult(model, True)


def test_a_broken_promise_names_the_pass_and_the_value(mlp_path: str) -> None:
    model = run_passes(load_model(mlp_path), import_passes(TrainingOptions()))
    first = next(iter(model.graph))
    broken = f"'drops_shapes' ensures 'static shapes'.*'{first.outputs[0].name}'"
    with pytest.raises(ir.passes.PostconditionError, match=broken):
        run_passes(model, [_DropsShapes()])
    with pytest.raises(ir.passes.PreconditionError, match="'attach_loss' requires 'static shapes'.*run infer_shapes"):
        run_passes(model, [AttachLoss("cross_entropy")])


def test_a_user_error_in_a_pass_reaches_the_caller_unwrapped(mlp_path: str) -> None:
    with pytest.raises(TrainableSetError, match="nothing to train"):
        build_training_graph(load_model(mlp_path), TrainingOptions(freeze=".*"))


def test_the_step_under_the_pass_manager_trains(mlp_path: str, tmp_path) -> None:
    step = build_training_graph(load_model(mlp_path), TrainingOptions(optimizer=OptimizerConfig(name="sgd", lr=0.1)))
    path = str(tmp_path / "step.onnx")
    ir.save(step, path)
    trainer = ReferenceStep(path)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((4, 6)).astype(np.float32), "labels": np.array([0, 1, 2, 1])}
    losses = [trainer.step(batch) for _ in range(10)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("moved,after,fact", [
    (MemoryPlanPass, FuseKernels, "'memory_plan' requires 'storage precision'.*put storage_precision before"),
    (MemoryPlanPass, TileRemap, "'memory_plan' requires 'kernels'.*put fuse before"),
    (StoragePrecision, MemoryPlanPass, "'memory_plan' requires 'storage precision'.*put storage_precision before"),
    (TileRemap, MemoryPlanPass, "'rtile_select' requires 'index maps'.*put tile_remap before"),
    (RTileSelect, MemoryPlanPass, "'memory_plan' requires 'layouts'.*put rtile_select before"),
    (FuseKernels, MemoryPlanPass, "'kernel_schedules' requires 'kernels'.*put fuse before"),
])
def test_lowering_passes_out_of_order_are_refused(moved, after, fact) -> None:
    """Lowering's facts (index maps, layouts, kernel order, storage precision) make its order checked too."""
    for layout in ("rtile", "naive"):
        passes = compile_pipeline(TrainingOptions(layout=layout), load_profile("adreno830"))
        check_order(passes)
        kept = [p for p in passes if not isinstance(p, moved)]
        kept.insert(next(i for i, p in enumerate(kept) if isinstance(p, after)) + 1,
                    next(p for p in passes if isinstance(p, moved)))
        with pytest.raises(ir.passes.PreconditionError, match=fact):
            check_order(kept)


def test_lowering_facts_hold_after_the_compile_pipeline_and_name_what_breaks_them(mlp_path: str) -> None:
    options = TrainingOptions()
    step = run_passes(load_model(mlp_path), compile_pipeline(options, load_profile("adreno830")))
    lowering = ("index maps", "layouts", "kernels", "kernel order", "storage precision", "memory plan")
    assert {name: FACTS[name].problem(step) for name in lowering} == dict.fromkeys(lowering)
    node = next(n for n in step.graph if n.metadata_props.get(keys.KERNEL, "").startswith("k"))
    last = max(int(n.metadata_props[keys.KERNEL][1:]) for n in step.graph
               if n.metadata_props.get(keys.KERNEL, "").startswith("k"))
    node.metadata_props[keys.KERNEL] = f"k{last + 1}"
    assert "k" in FACTS["kernel order"].problem(step)
    stored = next(v for v in step.graph.inputs if keys.STORAGE in v.metadata_props)
    del stored.metadata_props[keys.STORAGE]
    assert FACTS["storage precision"].problem(step) == f"'{stored.name}' has no {keys.STORAGE}"
    with pytest.raises(ir.passes.PreconditionError, match="'memory_plan' requires 'kernel order'"):
        run_passes(step, [MemoryPlanPass()])
