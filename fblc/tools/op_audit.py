"""The op audit: the ops torch.onnx.export writes, and what fblc's registries hold for each.

    python -m fblc.tools.op_audit > docs/OPS.md

The list of ops (`EXPORTED_OPS`, the op table's `exported` column, fblc/compiler/ops.py) is data:
what the exporters (dynamo at opset 18 and later, and the legacy TorchScript exporter) write for
the torch.nn modules and functional ops models use. Every status column comes from the registries
(and the LOWERINGS tables of lower_composites, lower_recurrent and lower_dft: an op rewritten at import is
*lowered*) at the time the table is generated, so a new gradient rule or kernel shows up by regenerating it;
tests/test_op_audit.py fails while docs/OPS.md is stale, and checks that every op a registry holds is in
the table (ops fblc registers that no exporter list names get a section of their own).
"""

from __future__ import annotations

import sys
from typing import Sequence

import onnx_ir as ir

from fblc.codegen.kernels import KERNEL_EMITTERS
from fblc.compiler.autodiff import GRADIENTS
from fblc.compiler.index_map import ALWAYS_VIEWS
from fblc.compiler.ops import DATA_DEPENDENT as DATA_DEPENDENT_SHAPE
from fblc.compiler.ops import INTEGER_OUTPUTS, OPS, PRELOADED, ops_where
from fblc.compiler.shape_rules import SHAPE_RULES
from fblc.compiler.shapes import has_shape_inference
from fblc.passes.ftd_taxonomy import FTD_CLASSES, UNKNOWN_OP_CLASS
from fblc.passes.lower_composites import LOWERINGS as COMPOSITES
from fblc.passes.lower_dft import DFT_LOWERINGS
from fblc.passes.lower_recurrent import LOWERINGS as RECURRENT
from fblc.passes.split_softmax import SPLITS

#: (op type, what in PyTorch makes the exporters write it): the op table's `exported` column
EXPORTED_OPS: tuple[tuple[str, str], ...] = tuple((op, entry.exported) for op, entry in OPS.items()
                                                  if entry.exported is not None)

#: ops whose outputs are integers, booleans or constants: no gradient flows through them, so
#: none is needed (a float tensor reaching them gets its gradient through other paths)
NO_GRADIENT_NEEDED = ops_where(lambda entry: entry.no_gradient == INTEGER_OUTPUTS)

#: ops onnx infers shapes for, whose output shape still depends on the data (the import refuses them)
DATA_DEPENDENT = ops_where(lambda entry: entry.no_kernel == DATA_DEPENDENT_SHAPE)
PRELOADED_OPS = ops_where(lambda entry: entry.no_kernel == PRELOADED)

#: the status of an op that an import lowering (lower_composites, lower_recurrent, lower_dft) rewrites into ops
#: with a rule and a kernel
LOWERED = "lowered"
#: op -> (the ops it is lowered into, the forms left or refused), of both import lowerings
LOWERINGS: dict[str, tuple[str, str]] = {**{op: (entry.into, entry.limits)
                                            for op, entry in (COMPOSITES | DFT_LOWERINGS).items()},
                                         **{op: (cell.into, cell.limits) for op, cell in RECURRENT.items()}}

COLUMNS = ("op", "written for", "import", "gradient", "kernel", "layout class", "emitted shape rule")


def _node(op: str) -> ir.Node:
    """A bare node of `op`: the registries answer by op type (and domain)."""
    return ir.Node("", op, [])


def status(op: str) -> tuple[str, str, str, str, str]:
    """import, gradient, kernel, layout class and emitted shape rule of `op`, from the registries;
    an op lower_composites rewrites at import is *lowered* in the gradient, kernel and layout columns."""
    node = _node(op)
    if op in LOWERINGS:
        return "yes", LOWERED, LOWERED, LOWERED, "yes" if SHAPE_RULES.has(node) else "-"
    imported = ("no shape inference" if not has_shape_inference(op) else
                "data-dependent shape" if op in DATA_DEPENDENT else "yes")
    if GRADIENTS.has(node):
        gradient = "yes"
    else:
        gradient = "not needed" if op in NO_GRADIENT_NEEDED else "no"
    if op in ALWAYS_VIEWS:
        kernel = "view"  # reads its input's texture, no kernel
    elif op in PRELOADED_OPS:
        kernel = "preloaded"
    elif op in SPLITS:
        kernel = "split: ReduceLogSumExp + map"  # fblc.passes.split_softmax, after the gradients
    else:
        kernel = "yes" if KERNEL_EMITTERS.has(node) else "no"
    found = FTD_CLASSES.get(node, None)
    layout = found.value if found is not None else f"{UNKNOWN_OP_CLASS.value} (default)"
    emitted = "yes" if SHAPE_RULES.has(node) else "-"
    return imported, gradient, kernel, layout, emitted


def _cell(text: str) -> str:
    """`|` would end the cell and `*` start emphasis (`**`, `|` are operators in the list)."""
    return text.replace("|", "\\|").replace("*", "\\*")


def _markdown(rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(" --- " for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def registered_ops() -> list[str]:
    """Every op a gradient rule or a kernel emitter serves."""
    return sorted(set(GRADIENTS.supported()) | set(KERNEL_EMITTERS.supported()))


#: onnx node-test cases (benchmarks/onnx_conformance.py, docs/CONFORMANCE.md) of ops with a kernel that fblc does not
#: pass, on purpose: (op, cases, why)
DEVIATIONS = [
    ("Attention", "test_attention_4d_gqa_with_past_and_present_fp16_expanded",
     "a float16 model computes in float32 (the bundle's --dtype, not the model's declared type) and returns float32; "
     "onnx's expected values of an `_expanded` graph round every node's result to float16. One of 576 outputs "
     "differs by 0.000512 at 0.505 (1.05 float16 ulps) where the case's rtol 1e-3 allows 0.000505: fblc keeps "
     "float32 between nodes where the reference rounds each to float16"),
    ("DFT", "test_dft_inverse_opset19",
     "the inverse of a real input's transform along axis 1 is exactly 0 at 20 of its 200 outputs; fblc's sums give "
     "0 there (10 of them, got 0), onnx's expected values hold float32 rounding of up to 1.91e-7, above the case's "
     "atol of 1e-7 (the expected values differ from a float64 inverse by up to 1.5e-6 elsewhere, within rtol)"),
]


def render() -> str:
    """docs/OPS.md."""
    listed = [op for op, _ in EXPORTED_OPS]
    rows = [(op, written, *status(op)) for op, written in EXPORTED_OPS]
    extra = [op for op in registered_ops() if op not in listed]
    trains = sum(1 for r in rows if r[3] in ("yes", "not needed", LOWERED)
                 and r[4] in ("yes", "view", "preloaded", LOWERED))
    lines = [
        "# Op audit",
        "",
        "Generated from fblc's registries by `python -m fblc.tools.op_audit > docs/OPS.md`; do not edit by hand.",
        "`tests/test_op_audit.py` fails while this file is stale: regenerate it after adding a gradient rule,",
        "a kernel emitter, an FTD class or a shape rule (docs/ARCHITECTURE.md, section 8).",
        "",
        "Columns: **import**: the import infers the op's static shapes (onnx's shape inference); **gradient**: a",
        "gradient rule (`fblc/compiler/gradients/`), or *not needed* for ops whose outputs carry no gradient;",
        "**kernel**: an OpenCL kernel emitter (`fblc/codegen/kernels/`), *view* when the op reads its input's",
        "texture; **layout class**: the FTD class (`fblc/passes/ftd_taxonomy.py`), *(default)* when the op is",
        "not in the table; **emitted shape rule**: an entry in `fblc/compiler/shape_rules.py`, needed only by",
        "ops that gradient rules, losses and optimizers emit. A *yes* means the table has an entry: an entry",
        "may still refuse some attributes (each refusal is an unsupported-op error naming the node).",
        "*lowered*: the import (`fblc/passes/lower_composites.py`, `lower_recurrent.py`, `lower_dft.py`) rewrites",
        "the op into ops that have a gradient rule and a kernel (the last section lists into which).",
        "`fblc check MODEL` gives the same statuses for one model's ops, and whether it trains.",
        "",
        f"## Ops torch.onnx.export writes ({len(rows)} ops; {trains} with a gradient and a kernel)",
        "",
        *_markdown(rows),
    ]
    if extra:
        lines += ["", "## Other ops fblc registers", "",
                  "Ops with a gradient rule or a kernel that the list above does not name (fblc emits them, or",
                  "exporters write them for rarer modules).", "",
                  *_markdown([(op, "-", *status(op)) for op in extra])]
    lines += ["", "## Ops lowered at import", "",
              "`fblc/passes/lower_composites.py`, `fblc/passes/lower_recurrent.py` and `fblc/passes/lower_dft.py` "
              "(their `LOWERINGS` tables) rewrite these", "before shape inference; the recurrent ops are unrolled over "
              "their static sequence length.", "",
              "| op | lowered to | not lowered |", "| --- | --- | --- |",
              *[f"| {op} | {_cell(into)} | {_cell(limits or '-')} |" for op, (into, limits) in LOWERINGS.items()]]
    lines += ["", "## Deviations from ONNX's node tests", "",
              "Cases of `benchmarks/onnx_conformance.py` (docs/CONFORMANCE.md) of ops with a kernel that fail on "
              "purpose.", "", "| op | cases | why |", "| --- | --- | --- |",
              *[f"| {op} | {cases} | {why} |" for op, cases, why in DEVIATIONS]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
