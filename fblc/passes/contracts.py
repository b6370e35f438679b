"""Pass contracts: the facts a pass requires of its input and ensures of its output, checked as it runs.

A fact is a named property of the model with a check that says what breaks it (None when it
holds). A pass lists the facts in `requires_facts` / `ensures_facts`; onnx_ir's `PassBase`
calls `requires` before `call` and `ensures` after it, so a pass run out of order, or one that
breaks its promise, stops with the pass, the fact, the first offending value or node, and the
pass that establishes the fact. The pipeline's order is also checked before anything runs
(`check_order`): every required fact is ensured by an earlier pass or by import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.keys import Role


@dataclass(frozen=True)
class Fact:
    meaning: str
    established_by: str  # the pass that ensures it first
    problem: Callable[[ir.Model], str | None]


def _static(value: ir.Value) -> bool:
    return value.shape is not None and value.shape.is_static() and value.dtype is not None


def _first(items: Sequence[str]) -> str | None:
    return items[0] if items else None


def _unshaped_input(model: ir.Model) -> str | None:
    return _first([f"input '{v.name}' has shape {v.shape}" for v in model.graph.inputs if not _static(v)])


def _unshaped_value(model: ir.Model) -> str | None:
    return _first([f"'{v.name}' (output of {n.op_type} '{n.name}') has shape {v.shape}, dtype {v.dtype}"
                   for n in model.graph for v in n.outputs if v is not None and v.uses() and not _static(v)])


def _params(model: ir.Model) -> list[ir.Value]:
    return [v for v in model.graph.inputs if keys.get_role(v) == Role.PARAM.value]


def _no_trainable_inputs(model: ir.Model) -> str | None:
    return None if _params(model) else f"no graph input has {keys.ROLE} '{Role.PARAM.value}'"


def _no_loss(model: ir.Model) -> str | None:
    outputs = model.graph.outputs
    if not outputs or outputs[0].name != "loss":
        return f"output 0 is '{outputs[0].name if outputs else None}', not 'loss'"
    shape = outputs[0].shape
    return None if shape is not None and shape.is_static() and len(shape) == 0 else f"'loss' has shape {shape}"


def _missing_outputs(suffix: str) -> Callable[[ir.Model], str | None]:
    def problem(model: ir.Model) -> str | None:
        names = {v.name for v in model.graph.outputs}
        return _first([f"parameter '{p.name}' has no output '{p.name}{suffix}'" for p in _params(model)
                       if f"{p.name}{suffix}" not in names])

    return problem


def _unlabelled(key: str, what: str,
                skip: Callable[[ir.Node], bool] = lambda node: False) -> Callable[[ir.Model], str | None]:
    def problem(model: ir.Model) -> str | None:
        return _first([f"{n.op_type} '{n.name}' has no {key} ({what})" for n in model.graph
                       if key not in n.metadata_props and not skip(n)])

    return problem


def _no_layout_mode(model: ir.Model) -> str | None:
    return None if keys.LAYOUT_MODE in model.graph.metadata_props else f"the graph has no {keys.LAYOUT_MODE}"


FACTS: dict[str, Fact] = {
    "static inputs": Fact("every graph input has a static shape and a dtype", "fix_input_shapes", _unshaped_input),
    "static shapes": Fact("every value a node reads has a static shape and a dtype", "infer_shapes", _unshaped_value),
    "trainable inputs": Fact("the trainable parameters are graph inputs with role 'param'", "mark_trainable",
                             _no_trainable_inputs),
    "loss": Fact("output 0 is the scalar 'loss'", "attach_loss", _no_loss),
    "gradients": Fact("every trainable parameter P has an output P.grad", "build_gradients", _missing_outputs(".grad")),
    "updates": Fact("every trainable parameter P has an output P.new", "optimizer_step", _missing_outputs(".new")),
    "ftd classes": Fact("every node has an FTD class", "ftd_taxonomy", _unlabelled(keys.FTD, "an FTD class")),
    "layouts": Fact("the graph records its layout mode", "rtile_select", _no_layout_mode),
    "kernels": Fact("every node belongs to a kernel (or is an alias)", "fuse",
                    _unlabelled(keys.KERNEL, "a kernel", skip=lambda n: n.op_type == "Constant")),
}


def _check(graph_pass: ir.passes.PassBase, model: ir.Model, facts: Sequence[str],
           error: type[ir.passes.InvariantError], verb: str) -> None:
    for name in facts:
        fact = FACTS[name]
        problem = fact.problem(model)
        if problem is not None:
            hint = (f"run {fact.established_by} before it" if verb == "requires" else
                    f"{getattr(graph_pass, 'name', type(graph_pass).__name__)} broke it")
            raise error(f"pass '{getattr(graph_pass, 'name', type(graph_pass).__name__)}' {verb} '{name}' "
                        f"({fact.meaning}), but {problem}; {hint}")


class ContractPass(ir.passes.InPlacePass):
    """An in-place pass with declared contracts: facts it needs before and promises after."""

    name: ClassVar[str] = "pass"
    requires_facts: ClassVar[tuple[str, ...]] = ()
    ensures_facts: ClassVar[tuple[str, ...]] = ()

    def requires(self, model: ir.Model) -> None:
        _check(self, model, self.requires_facts, ir.passes.PreconditionError, "requires")

    def ensures(self, model: ir.Model) -> None:
        _check(self, model, self.ensures_facts, ir.passes.PostconditionError, "ensures")


def check_order(passes: Sequence[ir.passes.PassBase], given: Sequence[str] = ()) -> None:
    """Every fact a pass requires is ensured by an earlier pass (or `given`); raises PreconditionError."""
    known = set(given)
    for graph_pass in passes:
        needed = getattr(graph_pass, "requires_facts", ())
        missing = [f for f in needed if f not in known]
        if missing:
            fact = FACTS[missing[0]]
            raise ir.passes.PreconditionError(
                f"pass '{getattr(graph_pass, 'name', graph_pass)}' requires '{missing[0]}' ({fact.meaning}), which no "
                f"earlier pass ensures; put {fact.established_by} before it")
        known |= set(getattr(graph_pass, "ensures_facts", ()))
