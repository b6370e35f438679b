"""The op audit: the ops torch.onnx.export writes, and what fblc's registries hold for each.

    python -m fblc.tools.op_audit > docs/OPS.md

The list of ops (`EXPORTED_OPS`) is data: what the exporters (dynamo at opset 18 and later,
and the legacy TorchScript exporter) write for the torch.nn modules and functional ops models
use. Every status column comes from the registries (and lower_composites' LOWERINGS table: an op
rewritten at import is *lowered*) at the time the table is generated, so a new
gradient rule or kernel shows up by regenerating it; tests/test_op_audit.py fails while
docs/OPS.md is stale, and checks that every op a registry holds is in the table (ops fblc
registers that no exporter list names get a section of their own).
"""

from __future__ import annotations

import sys
from typing import Sequence

import onnx_ir as ir

from fblc.codegen.kernels import KERNEL_EMITTERS
from fblc.compiler.autodiff import GRADIENTS
from fblc.compiler.index_map import ALWAYS_VIEWS
from fblc.compiler.shape_rules import SHAPE_RULES
from fblc.compiler.shapes import has_shape_inference
from fblc.passes.ftd_taxonomy import FTD_CLASSES, UNKNOWN_OP_CLASS
from fblc.passes.lower_composites import LOWERINGS
from fblc.passes.split_softmax import SPLITS

#: (op type, what in PyTorch makes the exporters write it)
EXPORTED_OPS: tuple[tuple[str, str], ...] = (
    # contractions
    ("Conv", "nn.Conv1d/2d/3d, F.conv2d"),
    ("ConvTranspose", "nn.ConvTranspose1d/2d"),
    ("Gemm", "nn.Linear on 2-D input (legacy exporter)"),
    ("MatMul", "nn.Linear (dynamo), torch.matmul, @, attention"),
    ("Einsum", "torch.einsum"),
    # normalisation
    ("BatchNormalization", "nn.BatchNorm1d/2d"),
    ("LayerNormalization", "nn.LayerNorm, F.layer_norm"),
    ("GroupNormalization", "nn.GroupNorm (dynamo)"),
    ("InstanceNormalization", "nn.InstanceNorm2d, nn.GroupNorm (legacy)"),
    # activations
    ("Relu", "nn.ReLU, F.relu"),
    ("LeakyRelu", "nn.LeakyReLU"),
    ("PRelu", "nn.PReLU"),
    ("Elu", "nn.ELU"),
    ("Selu", "nn.SELU"),
    ("Celu", "nn.CELU"),
    ("Gelu", "nn.GELU at opset 20 and later (exact and tanh)"),
    ("Erf", "nn.GELU (exact) before opset 20"),
    ("Sigmoid", "nn.Sigmoid, nn.SiLU (x * sigmoid(x))"),
    ("Tanh", "nn.Tanh, GELU with approximate='tanh'"),
    ("HardSigmoid", "nn.Hardsigmoid"),
    ("HardSwish", "nn.Hardswish (MobileNetV3)"),
    ("Softplus", "nn.Softplus, state-space models"),
    ("Mish", "nn.Mish"),
    ("Softsign", "nn.Softsign"),
    ("Clip", "torch.clamp, nn.ReLU6, nn.Hardtanh"),
    ("Softmax", "nn.Softmax, attention"),
    ("LogSoftmax", "nn.LogSoftmax, F.cross_entropy"),
    # pooling and resampling
    ("MaxPool", "nn.MaxPool1d/2d"),
    ("AveragePool", "nn.AvgPool1d/2d"),
    ("GlobalAveragePool", "nn.AdaptiveAvgPool2d(1)"),
    ("GlobalMaxPool", "nn.AdaptiveMaxPool2d(1)"),
    ("Resize", "nn.Upsample, F.interpolate"),
    ("DepthToSpace", "nn.PixelShuffle (legacy exporter)"),
    ("SpaceToDepth", "nn.PixelUnshuffle (legacy exporter)"),
    # arithmetic
    ("Add", "+, biases, residuals"),
    ("Sub", "-"),
    ("Mul", "*, scales, gates"),
    ("Div", "/, attention scaling"),
    ("Pow", "**, x.pow"),
    ("Sqrt", "torch.sqrt, norms"),
    ("Reciprocal", "torch.reciprocal, 1 / x"),
    ("Exp", "torch.exp"),
    ("Log", "torch.log"),
    ("Neg", "-x"),
    ("Abs", "torch.abs"),
    ("Sin", "torch.sin, rotary embeddings"),
    ("Cos", "torch.cos, rotary embeddings"),
    ("Max", "torch.maximum"),
    ("Min", "torch.minimum"),
    ("Sum", "sum of many tensors"),
    ("Floor", "torch.floor"),
    ("Sign", "torch.sign"),
    ("Ceil", "torch.ceil"),
    ("Round", "torch.round"),
    # reductions and scans
    ("ReduceSum", "torch.sum"),
    ("ReduceMean", "torch.mean, RMSNorm"),
    ("ReduceMax", "torch.amax, x.max(dim)"),
    ("ReduceMin", "torch.amin"),
    ("ReduceL2", "torch.linalg.vector_norm, weight_norm"),
    ("ReduceLogSumExp", "torch.logsumexp"),
    ("PhiloxNormal", "not exported: fblc's on-device ES noise (--trainer es, pass es_noise)"),
    ("PhiloxWeightedSum", "not exported: fblc's on-device ES direction (--trainer es, pass es_noise)"),
    ("MergeRuns", "not exported: fblc's on-device sort of a long row scatter's rows (pass sort_scatter_rows)"),
    ("ScatterSortedRows", "not exported: fblc's row scatter over sorted rows (pass sort_scatter_rows)"),
    ("ReduceProd", "torch.prod"),
    ("CumSum", "torch.cumsum, position ids"),
    ("ArgMax", "torch.argmax"),
    ("TopK", "torch.topk, mixture-of-experts routing"),
    # indexing
    ("Gather", "nn.Embedding, x[:, 0], index_select"),
    ("GatherND", "x[..., [i], :], bias tables indexed by constants"),
    ("GatherElements", "torch.gather, F.cross_entropy"),
    ("ScatterND", "index_put, slice assignment"),
    ("ScatterElements", "torch.scatter"),
    ("OneHot", "F.one_hot"),
    ("Where", "torch.where, masked_fill"),
    ("Trilu", "torch.tril/triu (causal masks)"),
    ("NonZero", "torch.nonzero, x[mask]"),
    # data movement
    ("Reshape", "view, reshape"),
    ("Transpose", "permute, transpose, .T"),
    ("Flatten", "nn.Flatten (legacy exporter)"),
    ("Squeeze", "squeeze"),
    ("Unsqueeze", "unsqueeze, None indexing"),
    ("Expand", "expand, broadcast_to"),
    ("Tile", "Tensor.repeat"),
    ("Slice", "x[a:b], narrow"),
    ("Split", "torch.split, chunk"),
    ("Concat", "torch.cat, torch.stack"),
    ("Pad", "F.pad, padded convs"),
    # comparisons, casts and constants
    ("Equal", "==, masks"),
    ("Less", "<"),
    ("LessOrEqual", "<="),
    ("Greater", ">"),
    ("GreaterOrEqual", ">="),
    ("Not", "~, logical_not"),
    ("And", "&, logical_and"),
    ("Or", "|, logical_or"),
    ("IsNaN", "torch.isnan"),
    ("Cast", ".to(dtype), .float()"),
    ("Shape", "x.shape, x.size() (dynamic shapes)"),
    ("ConstantOfShape", "torch.zeros/ones/full of a computed size"),
    ("Range", "torch.arange"),
    ("Constant", "literals"),
    ("Identity", "no-ops the exporter keeps"),
    ("Dropout", "nn.Dropout (inference mode)"),
    # recurrent
    ("LSTM", "nn.LSTM (legacy exporter)"),
    ("GRU", "nn.GRU (legacy exporter)"),
)

#: ops whose outputs are integers, booleans or constants: no gradient flows through them, so
#: none is needed (a float tensor reaching them gets its gradient through other paths)
NO_GRADIENT_NEEDED = frozenset({
    "ArgMax", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "IsNaN", "NonZero",
    "Shape", "ConstantOfShape", "Range", "Constant", "OneHot"})

#: ops onnx infers shapes for, whose output shape still depends on the data (the import refuses them)
DATA_DEPENDENT = frozenset({"NonZero"})

#: the status of an op that `fblc.passes.lower_composites` rewrites into ops with a rule and a kernel
LOWERED = "lowered"

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
    elif op == "Constant":
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
        "*lowered*: the import (`fblc/passes/lower_composites.py`) rewrites the op into ops that have a gradient",
        "rule and a kernel (the last section lists into which).",
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
              "`fblc/passes/lower_composites.py` (its `LOWERINGS` table) rewrites these before shape inference.", "",
              "| op | lowered to | not lowered |", "| --- | --- | --- |",
              *[f"| {op} | {_cell(lowering.into)} | {_cell(lowering.limits or '-')} |"
                for op, lowering in LOWERINGS.items()]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
