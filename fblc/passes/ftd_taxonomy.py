"""ftd_taxonomy: write every node's FTD class (docs/ARCHITECTURE.md, section 2) as `fblc.ftd`.

The class describes the node's backward (FBLayout's taxonomy): FTD-D ops' backward reads
forward tensors along other axes than the forward, FTD-C ops' along the same axes; FTI-D ops
(data movement, reductions, gathers) and FTI-C ops (layout-transparent) need none. `fblc check`,
the dumps and the layout report show it; no layout depends on it (docs/ARCHITECTURE.md,
section 2, has the ablation that removed the search's FTD anchors). The class is the op table's
(fblc/compiler/ops.py); an op missing from it gets UNKNOWN_OP_CLASS, so an op the compiler cannot run is
reported where it fails: by the kernel emitters, as an unsupported op naming the node and the
supported ops.
Preconditions: none (any graph). In place; `modified` is true when any annotation changed.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.ops import OPS, Ftd
from fblc.compiler.registry import OpRegistry
from fblc.passes.contracts import ContractPass


#: op type -> FTD class, from the op table's `ftd` column (fblc/compiler/ops.py)
FTD_CLASSES: OpRegistry[Ftd] = OpRegistry("FTD class", "it has no layout class yet")
for _op_type, _entry in OPS.items():
    if _entry.ftd is not None:
        FTD_CLASSES.register(_op_type)(_entry.ftd)


#: the class of an op the table lacks: FTI-D claims the least (that its backward needs no forward
#: tensor and that it may move data), and `fblc check` marks it as a default
UNKNOWN_OP_CLASS = Ftd.INDEPENDENT_DIVERGENT


def ftd_class(node: ir.Node) -> Ftd:
    return FTD_CLASSES.get(node, UNKNOWN_OP_CLASS)


class FtdTaxonomy(ContractPass):
    """Annotate every node with its FTD class (in place)."""

    name = "ftd_taxonomy"
    requires_facts = ("static shapes",)
    ensures_facts = ("ftd classes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in model.graph:
            label = ftd_class(node).value
            if node.metadata_props.get(keys.FTD) != label:
                node.metadata_props[keys.FTD] = label
                modified = True
        return ir.passes.PassResult(model, modified)
