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
from fblc.compiler.index_map import REMAPPABLE, index_map_of, is_view, real_producer
from fblc.compiler.keys import Role
from fblc.compiler.values import is_float, static_shape


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
    if _params(model) or model.graph.metadata_props.get(keys.FORWARD_STEP) == "1":  # forward_step: none trains
        return None
    return f"no graph input has {keys.ROLE} '{Role.PARAM.value}'"


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


def _storage_roots(graph: ir.Graph) -> list[ir.Value]:
    """The values that own storage: graph inputs, initializers and the named outputs of nodes that are not views."""
    roots = list(graph.inputs) + list(graph.initializers.values())
    return roots + [v for n in graph if not is_view(n) for v in n.outputs if v is not None and v.name]


def _no_layout(model: ir.Model) -> str | None:
    if keys.LAYOUT_MODE not in model.graph.metadata_props:
        return f"the graph has no {keys.LAYOUT_MODE}"
    return _first([f"'{v.name}' has no {keys.LAYOUT}" for v in _storage_roots(model.graph)
                   if keys.LAYOUT not in v.metadata_props])


def _undecided_movement(model: ir.Model) -> str | None:
    """A data-movement node that is neither a view with a map of its output's shape nor a copy with a reason."""
    for node in model.graph:
        if node.op_type not in REMAPPABLE or node.domain != "":
            continue
        index_map = index_map_of(node)
        if index_map is None and keys.REMAP not in node.metadata_props:
            return f"{node.op_type} '{node.name}' has neither {keys.INDEX_MAP} nor {keys.REMAP}"
        output = node.outputs[0]
        if index_map is not None and output.shape is not None and index_map.shape != static_shape(output):
            return (f"{node.op_type} '{node.name}' has a {keys.INDEX_MAP} of shape {list(index_map.shape)} for an "
                    f"output of shape {list(static_shape(output))}")
    return None


def _unstored_float(model: ir.Model) -> str | None:
    return _first([f"'{v.name}' has no {keys.STORAGE}" for v in _storage_roots(model.graph)
                   if v.dtype is not None and is_float(v) and keys.STORAGE not in v.metadata_props])


def _launch(node: ir.Node | None) -> int | None:
    kernel = node.metadata_props.get(keys.KERNEL, "") if node is not None else ""
    return int(kernel[1:]) if kernel[:1] == "k" and kernel[1:].isdigit() else None


def _out_of_order(model: ir.Model) -> str | None:
    """Kernels not numbered k0..k<N-1>, or a kernel that reads what a later one writes."""
    launches = {_launch(n) for n in model.graph} - {None}
    if launches != set(range(len(launches))):
        missing = sorted(set(range(max(launches, default=-1) + 1)) - launches)
        return f"the kernels are not numbered k0 to k{len(launches) - 1} (no k{missing[0]})"
    for node in model.graph:
        launch = _launch(node)
        for value in node.inputs:
            made = _launch(real_producer(value)) if launch is not None and value is not None else None
            if made is not None and made > launch:  # type: ignore[operator]
                return f"{node.op_type} '{node.name}' (k{launch}) reads '{value.name}', which k{made} writes later"
    return None


def _no_memory_plan(model: ir.Model) -> str | None:
    return None if keys.MEMORY in model.metadata_props else f"the model has no {keys.MEMORY}"


FACTS: dict[str, Fact] = {
    "static inputs": Fact("every graph input has a static shape and a dtype", "fix_input_shapes", _unshaped_input),
    "static shapes": Fact("every value a node reads has a static shape and a dtype", "infer_shapes", _unshaped_value),
    "trainable inputs": Fact("the trainable parameters are graph inputs with role 'param' (none in a forward step)",
                             "mark_trainable",
                             _no_trainable_inputs),
    "loss": Fact("output 0 is the scalar 'loss'", "attach_loss", _no_loss),
    "gradients": Fact("every trainable parameter P has an output P.grad", "build_gradients", _missing_outputs(".grad")),
    "updates": Fact("every trainable parameter P has an output P.new", "optimizer_step", _missing_outputs(".new")),
    "ftd classes": Fact("every node has an FTD class", "ftd_taxonomy", _unlabelled(keys.FTD, "an FTD class")),
    "index maps": Fact("every data-movement node is a view with a map of its output (fblc.index_map) or a copy "
                       "with the reason (fblc.remap)", "tile_remap", _undecided_movement),
    "layouts": Fact("the graph records its layout mode and every stored value its texel layout", "rtile_select",
                    _no_layout),
    "kernels": Fact("every node belongs to a kernel (or is an alias)", "fuse",
                    _unlabelled(keys.KERNEL, "a kernel", skip=lambda n: n.op_type == "Constant")),
    "kernel order": Fact("kernels are numbered k0, k1, ... in launch order, and none reads what a later one writes",
                         "fuse", _out_of_order),
    "storage precision": Fact("every stored float value has its device format (fblc.storage)", "storage_precision",
                              _unstored_float),
    "memory plan": Fact("the model records its memory plan (fblc.memory)", "memory_plan", _no_memory_plan),
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
