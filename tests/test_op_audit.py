"""docs/OPS.md: the op audit stays what the registries say, and names every op they hold."""

from __future__ import annotations

import os

import pytest

from fblc.codegen.kernels import KERNEL_EMITTERS
from fblc.compiler.autodiff import GRADIENTS
from fblc.tools.op_audit import EXPORTED_OPS, render, status

OPS_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "OPS.md")
REGENERATE = "python -m fblc.tools.op_audit > docs/OPS.md"

#: what issue 12 asks the audit to cover, at least
REQUIRED = ("Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "LayerNormalization", "GroupNormalization",
            "InstanceNormalization", "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Gelu", "Erf", "Sigmoid", "Tanh",
            "HardSigmoid", "HardSwish", "Softplus", "Mish", "Softmax", "LogSoftmax", "MaxPool", "AveragePool",
            "GlobalAveragePool", "Resize", "DepthToSpace", "SpaceToDepth", "Einsum", "CumSum", "Tile", "OneHot",
            "Trilu", "TopK", "ArgMax", "Split", "Concat", "Gather", "GatherND", "GatherElements", "ScatterND", "Where",
            "Expand", "Reshape", "Transpose", "Slice", "Pad", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2",
            "Pow", "Sqrt", "Div")


def _documented() -> str:
    with open(OPS_MD, encoding="utf-8") as handle:
        return handle.read()


def test_docs_ops_md_is_current() -> None:
    assert _documented() == render(), f"docs/OPS.md is stale: regenerate it with `{REGENERATE}`"


@pytest.mark.parametrize("registry", [GRADIENTS, KERNEL_EMITTERS], ids=["gradients", "kernels"])
def test_every_registered_op_is_in_the_table(registry) -> None:
    rows = {line.split("|")[1].strip() for line in _documented().splitlines() if line.startswith("| ")}
    assert sorted(set(registry.supported()) - rows) == [], f"regenerate docs/OPS.md with `{REGENERATE}`"


def test_the_exporter_list_covers_the_common_modules_once() -> None:
    listed = [op for op, _ in EXPORTED_OPS]
    assert len(listed) == len(set(listed))
    assert sorted(set(REQUIRED) - set(listed)) == []


def test_statuses_come_from_the_registries() -> None:
    imported, gradient, kernel, layout, _ = status("MatMul")
    assert (imported, gradient, kernel, layout) == ("yes", "yes", "yes", "FTD-D")
    assert status("Identity")[2] == "view" and status("ArgMax")[1] == "not needed"
    assert status("NoSuchOp") == ("no shape inference", "no", "no", "FTI-D (default)", "-")
