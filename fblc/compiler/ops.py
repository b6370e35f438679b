"""The op table: one row per ONNX op type, with every fact the compiler's layers ask about an op.

A row says how the op is computed (its kind: fuse groups elementwise chains and contraction
epilogues by it, and the elementwise kernel serves every ELEMENTWISE op), whether it keeps samples
apart (batch_tile runs a CNN's front in batch chunks only through per-sample ops), which views its
kernel reads in place (tile_remap turns a movement op into an index map only where every reader
takes the view: otherwise a conversion kernel copies it), its FTD class (ftd_taxonomy), whether it
walks a row axis (the layout search's access patterns), its FLOP rule (by name, in flops.FLOP_RULES:
one per output element unless named), its shape rule (by name, in shape_rules.NAMED_RULES: only the
ops that gradient rules, losses and optimizers emit need one), and what makes torch.onnx.export
write it (the op audit, docs/OPS.md).

An op deliberately without a gradient rule or a kernel says why in `no_gradient` / `no_kernel`;
tests/test_op_table.py checks the table against the gradient registry, the kernel registry and the
elementwise expressions, so an op in one and missing from another fails there, not at compile time.
The rules that are code stay where they are (gradients in compiler/gradients, kernels in
codegen/kernels); docs/ARCHITECTURE.md, "Adding an op", is the recipe.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable


class Kind(str, enum.Enum):
    """How the compiler computes the op (eval BatchNormalization is a per-channel affine: elementwise)."""

    ELEMENTWISE = "elementwise"
    CONTRACTION = "contraction"
    REDUCTION = "reduction"
    NORMALIZATION = "normalization"
    POOLING = "pooling"
    MOVEMENT = "movement"
    VIEW = "view"  # reads its input's texture, no kernel
    INDEXING = "indexing"  # gathers, scatters, one-hot, top-k, arg-max
    SCAN = "scan"
    RESAMPLE = "resample"
    CONSTANT = "constant"
    NOISE = "noise"  # fblc's on-device ES noise
    SORT = "sort"  # fblc's sorted row scatters
    RECURRENT = "recurrent"


class Ftd(str, enum.Enum):
    """FBLayout's taxonomy of an op's backward (docs/ARCHITECTURE.md, section 2)."""

    DEPENDENT_DIVERGENT = "FTD-D"
    DEPENDENT_CONSISTENT = "FTD-C"
    INDEPENDENT_DIVERGENT = "FTI-D"
    INDEPENDENT_CONSISTENT = "FTI-C"


class Reads(enum.Flag):
    """The views of a stored tensor the op's kernel reads in place (passes/tile_remap.py).

    STRIDED: any strided view (index composition or explicit strides, never raw texel position);
    OFFSET: also one that starts past the root's first element (a Slice), every element through
    KernelBuilder.load; FOLDED: one whose axes are mixed-radix digits (KernelBuilder.load, or
    MatMul's nested K loops)."""

    NONE = 0
    STRIDED = enum.auto()
    OFFSET = enum.auto()
    FOLDED = enum.auto()


ANY_VIEW = Reads.STRIDED | Reads.OFFSET | Reads.FOLDED
BY_STRIDES = Reads.STRIDED  # contractions and gathers: strides alone, no offset, no folded axes
STRIDES_FOLDED = Reads.STRIDED | Reads.FOLDED  # MatMul's K loops and the reductions

# why an op has no gradient rule or no kernel ----------------------------------------------------
INTEGER_OUTPUTS = "its outputs are integers, booleans or constants: no gradient flows through it"
LOWERED = ("lowered at import (passes/lower_composites.py, passes/lower_recurrent.py and passes/lower_dft.py, "
           "their LOWERINGS tables) into ops that have one")
DEVICE_ONLY = ("fblc's own op, emitted after the backward (ES noise, sorted row scatters): never differentiated, "
               "and onnxruntime lacks it")
NOT_YET = "not written yet"
VIEW = "a view: its readers read its input's texture"
PRELOADED = "preloaded: its value is stored with the parameters"
SPLIT = "split after the gradients (passes/split_softmax.py) into ReduceLogSumExp and an elementwise map"
SHAPE_ARITHMETIC = "shape arithmetic: folded into constants at import for static shapes"
DATA_DEPENDENT = "its output shape depends on the data: the import refuses it"
QUANTIZED = ("dequantizes frozen integer weights (--weights int4/int8, or a quantized import): its inputs are "
             "constants, no gradient flows into them")


@dataclass(frozen=True)
class Op:
    """One op type's row (the helpers below fill the columns its kind implies)."""

    kind: Kind
    ftd: Ftd | None  # None: ftd_taxonomy's UNKNOWN_OP_CLASS
    exported: str | None = None  # what in PyTorch makes the exporters write it (None: fblc or rare modules)
    per_sample: bool = False
    reads: Reads = Reads.NONE
    row_axis: bool = False  # walks one axis (`axis`/`axes`) as a row: the layout search scores that walk
    flops: str = "output"  # a key of flops.FLOP_RULES
    shape: str | None = None  # a key of shape_rules.NAMED_RULES
    fuses_into_readers: bool = False  # an elementwise reader computes it per element from its inputs' textures
    remappable: bool = False  # movement tile_remap can turn into an index map (compiler/index_map.compose)
    weights: tuple[int, ...] = ()  # input slots that hold a layer's weights (compiler/trainable.py)
    constants: tuple[int, ...] = ()  # input slots no gradient flows into: a float initializer there is a constant
    no_gradient: str = ""
    no_kernel: str = ""


def _elementwise(ftd: Ftd, exported: str | None, shape: str | None = None, *, per_sample: bool = True,
                 no_gradient: str = "") -> Op:
    return Op(Kind.ELEMENTWISE, ftd, exported, per_sample=per_sample, reads=ANY_VIEW, shape=shape,
              no_gradient=no_gradient)


def _compare(exported: str, shape: str = "comparison") -> Op:
    return _elementwise(Ftd.INDEPENDENT_CONSISTENT, exported, shape, no_gradient=INTEGER_OUTPUTS)


def _reduce(exported: str, shape: str | None = "reduce", *, reads: Reads = STRIDES_FOLDED, row_axis: bool = True) -> Op:
    return Op(Kind.REDUCTION, Ftd.INDEPENDENT_DIVERGENT, exported, reads=reads, row_axis=row_axis, flops="input",
              shape=shape)


def _lowered(kind: Kind, exported: str, *, per_sample: bool = False) -> Op:
    return Op(kind, None, exported, per_sample=per_sample, no_gradient=LOWERED, no_kernel=LOWERED)


def _move(exported: str, shape: str | None = None, *, remappable: bool = False, reads: Reads = Reads.NONE) -> Op:
    return Op(Kind.MOVEMENT, Ftd.INDEPENDENT_DIVERGENT, exported, reads=reads, shape=shape, remappable=remappable)


def _index(exported: str | None, shape: str | None = None, *, reads: Reads = Reads.NONE, no_gradient: str = "") -> Op:
    return Op(Kind.INDEXING, Ftd.INDEPENDENT_DIVERGENT, exported, reads=reads, shape=shape, no_gradient=no_gradient)


D_D, D_C, I_D, I_C = (Ftd.DEPENDENT_DIVERGENT, Ftd.DEPENDENT_CONSISTENT, Ftd.INDEPENDENT_DIVERGENT,
                      Ftd.INDEPENDENT_CONSISTENT)

#: op type (default domain) -> its row; the exported ops first, in docs/OPS.md's order
OPS: dict[str, Op] = {
    # contractions
    "Conv": Op(Kind.CONTRACTION, D_D, "nn.Conv1d/2d/3d, F.conv2d", per_sample=True, reads=BY_STRIDES, flops="conv",
               shape="conv", weights=(1, 2)),
    "ConvTranspose": Op(Kind.CONTRACTION, D_D, "nn.ConvTranspose1d/2d", flops="conv_transpose", shape="conv_transpose",
                        weights=(1, 2)),
    "Gemm": Op(Kind.CONTRACTION, D_D, "nn.Linear on 2-D input (legacy exporter)", reads=BY_STRIDES, flops="gemm",
               shape="gemm", weights=(0, 1, 2)),
    "MatMul": Op(Kind.CONTRACTION, D_D, "nn.Linear (dynamo), torch.matmul, @, attention", reads=STRIDES_FOLDED,
                 flops="matmul", shape="matmul", weights=(0, 1)),
    "Einsum": _lowered(Kind.CONTRACTION, "torch.einsum"),
    "DFT": _lowered(Kind.CONTRACTION, "torch.fft.fft/rfft/ifft/irfft/fftn (dynamo exporter), FNet"),
    "STFT": _lowered(Kind.CONTRACTION, "torch.stft (dynamo exporter)"),
    # normalisation
    "BatchNormalization": Op(Kind.ELEMENTWISE, D_D, "nn.BatchNorm1d/2d", per_sample=True, flops="input",
                             weights=(1, 2)),
    "LayerNormalization": Op(Kind.NORMALIZATION, D_D, "nn.LayerNorm, F.layer_norm", row_axis=True, flops="input",
                             weights=(1, 2)),
    "GroupNormalization": _lowered(Kind.NORMALIZATION, "nn.GroupNorm (dynamo)"),
    "InstanceNormalization": Op(Kind.NORMALIZATION, D_D, "nn.InstanceNorm2d, nn.GroupNorm (legacy)"),
    # activations
    "Relu": _elementwise(D_C, "nn.ReLU, F.relu", "same"),
    "LeakyRelu": _elementwise(D_C, "nn.LeakyReLU", "same"),
    "PRelu": _elementwise(D_C, "nn.PReLU"),
    "Elu": _elementwise(D_C, "nn.ELU", "same"),
    "Selu": _elementwise(D_C, "nn.SELU"),
    "Celu": _elementwise(D_C, "nn.CELU"),
    "Gelu": _elementwise(D_C, "nn.GELU at opset 20 and later (exact and tanh)"),
    "Erf": _elementwise(D_C, "nn.GELU (exact) before opset 20", "same"),
    "Sigmoid": _elementwise(D_C, "nn.Sigmoid, nn.SiLU (x * sigmoid(x))", "same"),
    "Tanh": _elementwise(D_C, "nn.Tanh, GELU with approximate='tanh'", "same"),
    "HardSigmoid": _elementwise(D_C, "nn.Hardsigmoid", "same"),
    "HardSwish": _elementwise(D_C, "nn.Hardswish (MobileNetV3)"),
    "Softplus": _elementwise(D_C, "nn.Softplus, state-space models", "same"),
    "Mish": _elementwise(D_C, "nn.Mish"),
    "Softsign": _elementwise(D_C, "nn.Softsign", "same"),
    "Clip": _elementwise(D_C, "torch.clamp, nn.ReLU6, nn.Hardtanh", "same"),
    "Softmax": Op(Kind.NORMALIZATION, D_C, "nn.Softmax, attention", row_axis=True, shape="same", no_kernel=SPLIT),
    "LogSoftmax": Op(Kind.NORMALIZATION, D_C, "nn.LogSoftmax, F.cross_entropy", row_axis=True, shape="same",
                     no_kernel=SPLIT),
    # pooling and resampling
    "MaxPool": Op(Kind.POOLING, D_D, "nn.MaxPool1d/2d", per_sample=True, shape="pool"),
    "AveragePool": Op(Kind.POOLING, D_D, "nn.AvgPool1d/2d", per_sample=True, shape="pool"),
    "GlobalAveragePool": Op(Kind.POOLING, D_D, "nn.AdaptiveAvgPool2d(1)", per_sample=True, flops="input"),
    "GlobalMaxPool": _lowered(Kind.POOLING, "nn.AdaptiveMaxPool2d(1)", per_sample=True),
    "Resize": Op(Kind.RESAMPLE, I_D, "nn.Upsample, F.interpolate (nearest, bilinear, bicubic, antialias)",
                 constants=(1, 2)),  # roi, scales
    "DepthToSpace": _lowered(Kind.MOVEMENT, "nn.PixelShuffle (legacy exporter)"),
    "SpaceToDepth": _lowered(Kind.MOVEMENT, "nn.PixelUnshuffle (legacy exporter)"),
    # arithmetic (per_sample=False: batch_tile never listed them; not yet checked there, so kept off)
    "Add": _elementwise(I_C, "+, biases, residuals", "arithmetic"),
    "Sub": _elementwise(I_C, "-", "arithmetic"),
    "Mul": _elementwise(D_C, "*, scales, gates", "arithmetic"),
    "Div": _elementwise(D_C, "/, attention scaling", "arithmetic"),
    "Pow": _elementwise(D_C, "**, x.pow", "arithmetic", per_sample=False),
    "Sqrt": _elementwise(D_C, "torch.sqrt, norms", "same"),
    "Reciprocal": _elementwise(D_C, "torch.reciprocal, 1 / x", "same", per_sample=False),
    "Exp": _elementwise(D_C, "torch.exp", "same"),
    "Log": _elementwise(D_C, "torch.log", "same", per_sample=False),
    "Neg": _elementwise(I_C, "-x", "same"),
    "Abs": _elementwise(D_C, "torch.abs", "same"),
    "Sin": _elementwise(D_C, "torch.sin, rotary embeddings", "same", per_sample=False),
    "Cos": _elementwise(D_C, "torch.cos, rotary embeddings", "same", per_sample=False),
    "Atan": _elementwise(D_C, "torch.atan, torch.atan2"),
    "Max": _elementwise(D_C, "torch.maximum", "arithmetic"),
    "Min": _elementwise(D_C, "torch.minimum", "arithmetic"),
    "Sum": _elementwise(I_C, "sum of many tensors", "arithmetic"),
    "Floor": _elementwise(I_C, "torch.floor"),
    "Sign": _elementwise(I_C, "torch.sign", "same"),
    "Ceil": _elementwise(I_C, "torch.ceil"),
    "Round": _elementwise(I_C, "torch.round"),
    # reductions and scans
    "ReduceSum": _reduce("torch.sum"),
    "ReduceMean": _reduce("torch.mean, RMSNorm"),
    "ReduceMax": _reduce("torch.amax, x.max(dim)"),
    "ReduceMin": _lowered(Kind.REDUCTION, "torch.amin"),
    "ReduceL2": _reduce("torch.linalg.vector_norm, weight_norm", None, row_axis=False),
    "ReduceLogSumExp": _reduce("torch.logsumexp", reads=Reads.NONE),
    "PhiloxNormal": Op(Kind.NOISE, I_C, "not exported: fblc's on-device ES noise (--trainer es, pass es_noise)",
                       flops="philox", shape="philox_normal", no_gradient=DEVICE_ONLY),
    "PhiloxWeightedSum": Op(Kind.NOISE, I_C, "not exported: fblc's on-device ES direction (--trainer es, pass "
                            "es_noise)", flops="philox_sum", shape="philox_normal", no_gradient=DEVICE_ONLY),
    "MergeRuns": Op(Kind.SORT, I_D, "not exported: fblc's on-device sort of a long row scatter's rows or a long "
                    "TopK line (passes sort_scatter_rows, sort_topk)", shape="merge_runs", no_gradient=DEVICE_ONLY),
    "ScatterSortedRows": Op(Kind.SORT, I_D, "not exported: fblc's row scatter over sorted rows (pass "
                            "sort_scatter_rows)", shape="scatter_sorted_rows", no_gradient=DEVICE_ONLY),
    "ReduceProd": Op(Kind.REDUCTION, None, "torch.prod", no_gradient=NOT_YET, no_kernel=NOT_YET),
    "CumSum": Op(Kind.SCAN, I_D, "torch.cumsum, position ids", shape="scan"),
    "ArgMax": _index("torch.argmax", "arg_reduce", no_gradient=INTEGER_OUTPUTS),
    "TopK": _index("torch.topk, mixture-of-experts routing"),
    # indexing
    "Gather": Op(Kind.INDEXING, I_D, "nn.Embedding, x[:, 0], index_select", reads=BY_STRIDES, weights=(0,),
                 shape="gather"),
    "GatherND": _index("x[..., [i], :], bias tables indexed by constants", "gather_nd", reads=BY_STRIDES),
    "GatherElements": _index("torch.gather, F.cross_entropy", "gather_elements", reads=BY_STRIDES),
    "ScatterND": _index("index_put (x[idx] = y), slice assignment (legacy)", "scatter"),
    "ScatterElements": _index("torch.scatter, scatter_add, slice assignment (dynamo)", "scatter", reads=BY_STRIDES),
    "OneHot": _index("F.one_hot", no_gradient=INTEGER_OUTPUTS),
    "Where": _elementwise(D_C, "torch.where, masked_fill", "where"),
    "Trilu": Op(Kind.MOVEMENT, I_D, "torch.tril/triu (causal masks)", shape="scan"),
    "NonZero": Op(Kind.INDEXING, None, "torch.nonzero, x[mask]", no_gradient=INTEGER_OUTPUTS, no_kernel=DATA_DEPENDENT),
    # data movement
    "Reshape": _move("view, reshape", "reshape", remappable=True),
    "Transpose": _move("permute, transpose, .T", "transpose", remappable=True, reads=ANY_VIEW),
    "Flatten": _move("nn.Flatten (legacy exporter)", remappable=True),
    "Squeeze": _move("squeeze", remappable=True),
    "Unsqueeze": _move("unsqueeze, None indexing", "unsqueeze", remappable=True),
    "Expand": _move("expand, broadcast_to", "expand", remappable=True, reads=ANY_VIEW),
    "Tile": _lowered(Kind.MOVEMENT, "Tensor.repeat"),
    "Slice": _move("x[a:b], narrow", "slice", remappable=True, reads=ANY_VIEW),
    "Split": _move("torch.split, chunk", "split"),
    "Concat": Op(Kind.MOVEMENT, I_D, "torch.cat, torch.stack", reads=ANY_VIEW, shape="concat", fuses_into_readers=True),
    "Pad": Op(Kind.MOVEMENT, I_D, "F.pad, padded convs", per_sample=True, reads=ANY_VIEW, shape="pad",
              fuses_into_readers=True),
    # comparisons, casts and constants
    "Equal": _compare("==, masks"),
    "Less": _compare("<"),
    "LessOrEqual": _compare("<="),
    "Greater": _compare(">"),
    "GreaterOrEqual": _compare(">="),
    "Not": _compare("~, logical_not", "same"),
    "And": _compare("&, logical_and"),
    "Or": _compare("|, logical_or"),
    "IsNaN": _elementwise(I_C, "torch.isnan", "is_nan", per_sample=False, no_gradient=INTEGER_OUTPUTS),
    "Cast": _elementwise(I_C, ".to(dtype), .float()", "cast"),
    # quantized models (onnxruntime's quantizer; MatMulNBits lowers to it) and --weights int4/int8 (quantize_weights)
    "DequantizeLinear": Op(Kind.INDEXING, I_D, None, shape="dequantize", constants=(1, 2), no_gradient=QUANTIZED),
    "Shape": Op(Kind.CONSTANT, None, "x.shape, x.size() (dynamic shapes)", no_gradient=INTEGER_OUTPUTS,
                no_kernel=SHAPE_ARITHMETIC),
    "ConstantOfShape": Op(Kind.CONSTANT, I_C, "torch.zeros/ones/full of a computed size", shape="constant_of_shape",
                          no_gradient=INTEGER_OUTPUTS),
    "Range": Op(Kind.CONSTANT, None, "torch.arange", no_gradient=INTEGER_OUTPUTS, no_kernel=SHAPE_ARITHMETIC),
    "Constant": Op(Kind.CONSTANT, I_C, "literals", no_gradient=INTEGER_OUTPUTS, no_kernel=PRELOADED),
    "Identity": Op(Kind.VIEW, I_C, "no-ops the exporter keeps", per_sample=True, shape="same", no_kernel=VIEW),
    "Dropout": Op(Kind.VIEW, I_C, "nn.Dropout (inference mode)", no_kernel=VIEW),
    # recurrent
    "LSTM": _lowered(Kind.RECURRENT, "nn.LSTM (both exporters)"),
    "GRU": _lowered(Kind.RECURRENT, "nn.GRU (both exporters)"),
    "RNN": _lowered(Kind.RECURRENT, "nn.RNN (legacy exporter; dynamo writes MatMul and Tanh/Relu)"),
    # registered, written by rarer modules
    "ThresholdedRelu": _elementwise(D_C, None, "same"),
    "ArgMin": _index(None, no_gradient=INTEGER_OUTPUTS),
}


def row(op_type: str) -> Op | None:
    """`op_type`'s row (default domain), or None for an op the table lacks."""
    return OPS.get(op_type)


def ops_where(test: Callable[[Op], bool]) -> frozenset[str]:
    return frozenset(op for op, entry in OPS.items() if test(entry))


def of_kind(kind: Kind) -> frozenset[str]:
    return ops_where(lambda entry: entry.kind is kind)


def reading(views: Reads) -> frozenset[str]:
    """The ops whose kernels read every one of `views` in place."""
    return ops_where(lambda entry: views in entry.reads)


ELEMENTWISE = of_kind(Kind.ELEMENTWISE)
CONTRACTIONS = ops_where(lambda entry: entry.kind is Kind.CONTRACTION and entry.no_kernel != LOWERED)
ALWAYS_VIEWS = of_kind(Kind.VIEW)
