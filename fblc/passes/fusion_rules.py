"""What fuse's kernel groups are made of and how their readers see them: the op kinds that chain or anchor a
kernel (ELEMENTWISE, CONTRACTIONS, REDUCTIONS, GATHERS), the `fblc.kernel` marks of nodes that run in no kernel
of their own (ALIAS, IN_READERS), a reduction's axes and signature, its elementwise prologue (reduction_prologue),
a Transpose its producer writes (written_by), a DequantizeLinear its readers dequantize (dequantized_in_readers,
DEQUANTIZING_READS). Pass fuse decides with these; memory_plan, storage_precision and codegen read its groups
through them.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from fblc.compiler import keys, ops
from fblc.compiler.index_map import is_view, map_of, read_uses
from fblc.compiler.gradients import reduce as reduce_rules
from fblc.compiler.values import numel, static_shape

ALIAS = "alias"
#: keys.KERNEL of a DequantizeLinear that every reader, a MatMul or Gemm reading it as B or a Conv or ConvTranspose
#: as W, dequantizes as it loads (codegen/reads.py): no kernel of its own, no texture for its float tensor
IN_READERS = "in_readers"
#: the op table's vocabulary (fblc/compiler/ops.py): elementwise ops chain, contractions take an epilogue
ELEMENTWISE = ops.ELEMENTWISE
CONTRACTIONS = ops.CONTRACTIONS
#: data movement that an elementwise kernel can compute per element from its inputs' textures (a select
#: between them, a bounds check): fused into its elementwise readers, never with its own producers
GATHERS = ops.ops_where(lambda entry: entry.fuses_into_readers)
#: reductions whose kernel (codegen/kernels/reduce.py) folds several sibling reductions and takes an elementwise
#: epilogue, like a contraction's: a gradient reduced over the batch and its optimizer update in one launch
REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp", "GlobalAveragePool"})
#: elementwise ops a reduction computes as it reads its input (codegen/kernels/reduce.py FoldInput): a texel of the
#: result from one texel of each operand
PROLOGUE_OPS = frozenset({"Add", "Sub", "Mul"})
FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16})


def reduced_axes(node: ir.Node) -> list[int]:
    """The axes reduction `node` folds (GlobalAveragePool: every spatial axis)."""
    if node.op_type == "GlobalAveragePool":
        return list(range(2, len(static_shape(node.inputs[0]))))
    return reduce_rules.reduced_axes(node)


#: the signature's mark of a total reduction (one output element: a sum over a whole tensor)
TOTAL = "total"


def reduction_signature(node: ir.Node) -> tuple:
    """What sibling reductions in one kernel share: input shape, reduced axes, output shape (one schedule). Total
    reductions of one stage share only their output: the kernel folds each input whole in turn, whatever its
    shape (the finite check over every parameter's gradient: one kernel for up to READ_IMAGE_ARGS of them)."""
    out = static_shape(node.outputs[0])
    if numel(out) == 1:
        return TOTAL, node.metadata_props.get(keys.STAGE, ""), out
    return static_shape(node.inputs[0]), tuple(reduced_axes(node)), out


def reduction_prologue(node: ir.Node) -> ir.Node | None:
    """The reduction whose kernel computes `node` as it reads it, or None. `node` (of PROLOGUE_OPS, float, no
    step output) must be read by that reduction (not a total one) alone, as its input in its own order, and its
    operands must be float tensors of its shape, each read in its order: texel t of the result is the op of their
    texels t. A
    BatchNorm's dgamma = sum(dy * x_hat) then reads dy and x_hat, and no map of the product is written."""
    out = node.outputs[0] if len(node.outputs) == 1 else None
    if node.op_type not in PROLOGUE_OPS or node.domain not in ("", "ai.onnx") or out is None \
            or out.is_graph_output() or out.dtype not in FLOATS:
        return None
    uses = [use for _, use in read_uses(out)]
    if len(uses) != 1 or uses[0].idx != 0 or uses[0].node.op_type not in REDUCTIONS \
            or numel(static_shape(uses[0].node.outputs[0])) == 1:
        return None  # a total reduction reads within READ_IMAGE_ARGS: a sum made beside its operands is one texture
    shape, read = static_shape(out), uses[0].node.inputs[0]
    operands_fit = all(v is not None and v.dtype == out.dtype and static_shape(v) == shape and map_of(v).contiguous
                       for v in node.inputs)
    return uses[0].node if operands_fit and static_shape(read) == shape and map_of(read).contiguous else None


def written_by(node: ir.Node) -> ir.Node | None:
    """The contraction whose kernel writes `node`'s output in `node`'s order (keys.WRITTEN_BY_PRODUCER: a conv
    weight gradient in W's own order), or None: `node`'s input must be that contraction's output, read by `node`
    alone."""
    if node.metadata_props.get(keys.REMAP) != keys.WRITTEN_BY_PRODUCER or node.inputs[0] is None:
        return None
    source = node.inputs[0]
    producer = source.producer()
    alone = len(list(source.uses())) == 1 and not source.is_graph_output()
    return producer if producer is not None and producer.op_type in CONTRACTIONS and alone else None


def dequantized_in_readers(node: ir.Node, through: Callable[[ir.Node], bool] = is_view) -> bool:
    """Whether `node` is a DequantizeLinear whose data only contractions read, each as its B operand (directly
    or through views: the backward's W^T), convs as their weight (Conv's W, its input gradient's ConvTranspose's
    W), and Gathers as their table (an embedding, tied to an LM head): they dequantize the elements they load, so
    the float weight never exists in memory. Any other reader (an elementwise op, GatherElements, a step output)
    gets the materialising
    kernel (codegen/kernels/dequantize.py). `through`: the nodes that are views (before tile_remap, the data
    movement that will become one: memory_plan's estimate for pass recompute)."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or node.outputs[0].is_graph_output():
        return False
    uses = [use for _, use in read_uses(node.outputs[0], through)]
    return bool(uses) and all((use.node.op_type, use.idx) in DEQUANTIZING_READS and use.node.domain in ("", "ai.onnx")
                              for use in uses)


#: the contractions whose kernels read a B operand (a conv's weight: Conv's W, its input gradient's ConvTranspose's
#: W) through ValueReads (element / texel, kernels/texel.fetch), which dequantizes
CONTRACTION_B = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose"})
#: (op, input) whose kernels read that input through ValueReads.element / texel, which dequantize a packed
#: weight in registers: a contraction's B (a conv's weight), a Gather's table (kernels/gather.py: an embedding row)
DEQUANTIZING_READS = frozenset({(op, 1) for op in CONTRACTION_B} | {("Gather", 0)})


def kernel_of(node: ir.Node) -> str | None:
    return node.metadata_props.get(keys.KERNEL)
