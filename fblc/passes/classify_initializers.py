"""classify_initializers: tag every initializer as a parameter (`param`) or a constant (`frozen`).

Rewrite: writes `fblc.role` on each initializer by the default rule of
`fblc.compiler.trainable` (float weights train; BN running statistics, exporter-marked
buffers and folded constants do not), and `fblc.torch_name` where the exporter recorded the
torch parameter (`fblc.compiler.torch_names`). Runs before constant folding so that folding never
consumes a weight, and so that constants created later are never mistaken for weights; and
before any pass renames or rewrites the nodes whose names and metadata record the torch names.
Preconditions: none. In place; `modified` is true when any role changed.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.torch_names import record_torch_names
from fblc.compiler.trainable import has_exporter_kinds, is_parameter_like
from fblc.passes.contracts import ContractPass


class ClassifyInitializers(ContractPass):
    """Tag initializers param/frozen by the default rule (in place)."""

    name = "classify_initializers"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        exporter_kinds = has_exporter_kinds(model.graph)
        modified = record_torch_names(model)
        for value in model.graph.initializers.values():
            role = Role.PARAM if is_parameter_like(value, exporter_kinds) else Role.FROZEN
            if keys.get_role(value) != role.value:
                keys.set_role(value, role)
                modified = True
        return ir.passes.PassResult(model, modified)
