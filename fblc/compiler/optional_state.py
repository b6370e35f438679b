"""The step as `fblc train-graph` writes it: state inputs that onnxruntime loads without a warning each.

In the step graph every parameter and optimizer state P is a graph input with an initializer of the
same name holding its current value: ONNX's way (IR version 4 on) to give an input a default. But
onnxruntime, loading such a file, logs a warning per tensor ("Initializer P appears in graph inputs
and will not be treated as constant value/weight", graph.cc, for every IR version from 4; below 4 it
refuses the feed: "Invalid input name"), and nothing in a valid file turns that off.

So the file declares each such P an optional tensor input and reads it through
`If(OptionalHasElement(P), OptionalGetElement(P), P.initial)`, the current value stored as the
initializer `P.initial`, which is no input. A caller feeds P as before (onnxruntime takes a plain
array for an optional tensor input), or leaves it out and the step runs from the current value; no
name is both an input and an initializer. The step graph fblc compiles keeps the plain form.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from fblc.errors import FblcError

#: the initializer that holds a state input's current value: `P.initial`
DEFAULT_SUFFIX = ".initial"
#: the names with_optional_state adds per state input P: P + each suffix
ADDED_SUFFIXES = (DEFAULT_SUFFIX, ".fed", ".fed_value", ".kept_value", ".value")


def _read_optional(state: ir.Value, default: ir.Value, value: ir.Value) -> list[ir.Node]:
    """Nodes that make `value`: `state` (an optional tensor input) when fed, else `default`."""
    present = ir.Value(name=f"{state.name}.fed", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    has = ir.Node("", "OptionalHasElement", [state], outputs=[present], name=f"{state.name}/fed")
    fed = ir.Value(name=f"{state.name}.fed_value", type=default.type, shape=default.shape)
    kept = ir.Value(name=f"{state.name}.kept_value", type=default.type, shape=default.shape)
    then_branch = ir.Graph([], [fed], nodes=[ir.Node("", "OptionalGetElement", [state], outputs=[fed])],
                           name=f"{state.name}/fed_branch")
    else_branch = ir.Graph([], [kept], nodes=[ir.Node("", "Identity", [default], outputs=[kept])],
                           name=f"{state.name}/default_branch")
    choose = ir.Node("", "If", [present], attributes=[ir.AttrGraph("then_branch", then_branch),
                                                       ir.AttrGraph("else_branch", else_branch)],
                     outputs=[value], name=f"{state.name}/or_default")
    return [has, choose]


def with_optional_state(model: ir.Model) -> ir.Model:
    """Rewrite (in place) every graph input that has an initializer of the same name into an optional
    tensor input defaulting to that value, kept as the initializer `NAME.initial`; returns `model`."""
    graph = model.graph
    taken = {v.name for v in [*graph.inputs, *graph.initializers.values()]} | {
        v.name for node in ir.traversal.RecursiveGraphIterator(graph) for v in node.outputs}
    reads: list[ir.Node] = []
    for state in [v for v in graph.inputs if graph.initializers.get(v.name) is v]:
        clash = next((f"{state.name}{suffix}" for suffix in ADDED_SUFFIXES if f"{state.name}{suffix}" in taken), None)
        if clash is not None:
            raise FblcError(f"the step reads its input '{state.name}' through a value named '{clash}', a name the "
                            "model already uses", "rename that tensor in the model, or write the step with "
                            "--plain-state-inputs")
        default = ir.Value(name=f"{state.name}{DEFAULT_SUFFIX}", type=state.type, shape=state.shape,
                           const_value=state.const_value)
        del graph.initializers[state.name]
        graph.register_initializer(default)
        value = ir.Value(name=f"{state.name}.value", type=state.type, shape=state.shape)
        state.replace_all_uses_with(value)  # before the reads of `state` below exist
        reads.extend(_read_optional(state, default, value))
        state.type, state.const_value = ir.OptionalType(state.type), None
    if reads:
        graph.insert_before(next(iter(graph)), reads)
    return model


def input_defaults(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The value each input of a step takes when not fed: its initializer of the same name, or the
    `NAME.initial` of an optional state input (with_optional_state)."""
    initializers: Mapping[str, onnx.TensorProto] = {t.name: t for t in model.graph.initializer}
    defaults = {}
    for graph_input in model.graph.input:
        tensor = initializers.get(graph_input.name)
        if tensor is None and graph_input.type.HasField("optional_type"):
            tensor = initializers.get(f"{graph_input.name}{DEFAULT_SUFFIX}")
        if tensor is not None:
            defaults[graph_input.name] = numpy_helper.to_array(tensor)
    return defaults
