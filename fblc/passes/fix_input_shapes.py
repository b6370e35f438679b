"""fix_input_shapes: give every graph input a static shape.

Rewrite: each dynamic dim of a model input takes its size from `--input-shape NAME=DIMS`;
the shapes of all other non-constant values are cleared so shape inference recomputes them
from the fixed inputs. Preconditions: none. In place. Error: an unknown dim without a given
shape, a shape for an input that does not exist, or one that contradicts a static dim.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import onnx_ir as ir

from fblc.errors import ShapeError
from fblc.passes.contracts import ContractPass


class FixInputShapes(ContractPass):
    """Fix dynamic input dims from user-given shapes (in place)."""

    name = "fix_input_shapes"
    ensures_facts = ("static inputs",)

    def __init__(self, input_shapes: Mapping[str, Sequence[int]]) -> None:
        super().__init__()
        self.input_shapes = {k: tuple(v) for k, v in input_shapes.items()}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        inputs = {v.name: v for v in graph.inputs}
        for name in self.input_shapes:
            if name not in inputs:
                raise ShapeError(f"--input-shape names '{name}', which is not a model input",
                                 f"the model's inputs are: {', '.join(inputs) or '(none)'}")
        modified = False
        for value in graph.inputs:
            new_shape = self._fixed_shape(value)
            if value.shape is None or tuple(value.shape) != new_shape:
                value.shape = ir.Shape(new_shape)
                modified = True
        if modified:
            for node in graph:
                for out in node.outputs:
                    if out.const_value is None:
                        out.shape = None
        return ir.passes.PassResult(model, modified)

    def _fixed_shape(self, value: ir.Value) -> tuple[int, ...]:
        given = self.input_shapes.get(value.name)
        declared = value.shape
        if declared is None:
            if given is None:
                raise ShapeError(f"model input '{value.name}' has no shape",
                                 f"pass --input-shape {value.name}=DIMS (for example 1x3x224x224)")
            return given
        if given is None:
            if not declared.is_static():
                dims = "x".join(str(d) if isinstance(d, int) else "?" for d in declared)
                raise ShapeError(f"model input '{value.name}' has dynamic dims [{dims}]",
                                 f"pass --input-shape {value.name}=DIMS with every dim given")
            return tuple(int(d) for d in declared)
        if len(given) != len(declared):
            raise ShapeError(f"--input-shape {value.name} has rank {len(given)} but the input has rank {len(declared)}",
                             "give one size per dim, separated by 'x'")
        for axis, (want, have) in enumerate(zip(given, declared)):
            if isinstance(have, int) and have != want:
                raise ShapeError(f"--input-shape {value.name} sets dim {axis} to {want} but the model fixes it at {have}",
                                 f"use {have} for that dim")
        return given
