"""infer_shapes: give every value a static shape and dtype.

Rewrite: none to the nodes; value shapes and dtypes are (re)computed by onnx's shape
inference. Preconditions: static graph input shapes. In place; fails with the first value
whose shape stays unknown, naming it and its node.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler.shapes import infer_shapes


class InferShapes(ir.passes.InPlacePass):
    """Static shape and dtype inference (in place)."""

    name = "infer_shapes"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, infer_shapes(model))
