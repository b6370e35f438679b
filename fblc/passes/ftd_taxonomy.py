"""ftd_taxonomy: write every node's FTD class (docs/ARCHITECTURE.md, section 2) as `fblc.ftd`.

The class describes the node's backward (FBLayout's taxonomy): FTD-D ops' backward reads
forward tensors along other axes than the forward, FTD-C ops' along the same axes; FTI-D ops
(data movement, reductions, gathers) and FTI-C ops (layout-transparent) need none. `fblc check`,
the dumps and the layout report show it; no layout depends on it (docs/ARCHITECTURE.md,
section 2, has the ablation that removed the search's FTD anchors). The table is keyed by op
type; an op missing from it gets UNKNOWN_OP_CLASS, so an op the compiler cannot run is
reported where it fails: by the kernel emitters, as an unsupported op naming the node and the
supported ops.
Preconditions: none (any graph). In place; `modified` is true when any annotation changed.
"""

from __future__ import annotations

import enum

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.registry import OpRegistry
from fblc.passes.contracts import ContractPass


class Ftd(str, enum.Enum):
    DEPENDENT_DIVERGENT = "FTD-D"
    DEPENDENT_CONSISTENT = "FTD-C"
    INDEPENDENT_DIVERGENT = "FTI-D"
    INDEPENDENT_CONSISTENT = "FTI-C"


FTD_CLASSES: OpRegistry[Ftd] = OpRegistry("FTD class", "it has no layout class yet")


def _classify(ftd: Ftd, *op_types: str) -> None:
    FTD_CLASSES.register(*op_types)(ftd)


# backward reads forward tensors, and reduces them along other axes than the forward
_classify(Ftd.DEPENDENT_DIVERGENT, "MatMul", "Gemm", "Conv", "ConvTranspose", "BatchNormalization",
          "LayerNormalization", "InstanceNormalization", "AveragePool", "MaxPool", "GlobalAveragePool")
# backward reads forward tensors along the same axes
_classify(Ftd.DEPENDENT_CONSISTENT, "Relu", "Clip", "Sigmoid", "Tanh", "Erf", "Mul", "Div", "Pow", "Softmax",
          "LogSoftmax", "Exp", "Log", "Sqrt", "Reciprocal", "Sin", "Cos", "Abs", "Max", "Min", "Where", "HardSigmoid",
          "HardSwish", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "Softplus", "Mish", "Softsign",
          "Gelu")
# no forward tensor in the backward; the access pattern changes (index-remapping candidates)
_classify(Ftd.INDEPENDENT_DIVERGENT, "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand",
          "ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp", "Gather", "GatherElements", "GatherND", "ScatterElements",
          "ScatterND", "ScatterSortedRows", "MergeRuns", "Slice", "Concat", "Split", "Pad",
          "Resize", "CumSum", "Trilu", "OneHot", "ArgMax", "ArgMin", "TopK")
# layout-transparent
_classify(Ftd.INDEPENDENT_CONSISTENT, "Add", "Sub", "Neg", "Cast", "Identity", "Dropout", "Sum", "Constant",
          "ConstantOfShape", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Not",
          "IsNaN", "Floor", "Sign", "Ceil", "Round", "PhiloxNormal",
          "PhiloxWeightedSum")


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
