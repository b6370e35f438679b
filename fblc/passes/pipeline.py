"""The one ordered list of passes, from an imported ONNX model to the training step graph.

`import_passes` make any exporter's output static and folded; `training_passes` build the
step. With a dump directory every pass's result is written as `NN_<pass>.onnx`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import onnx_ir as ir

from fblc.compiler import ops
from fblc.compiler.adapters import MEMORY_FLOOR_ADAPTERS, AdapterConfig
from fblc.errors import FblcError
from fblc.compiler.model_io import save_model_atomically
from fblc.choices import FORWARD
from fblc.compiler.es import LOSS_ONLY_REWARDS, TRAINERS, EsConfig
from fblc.compiler.loss_scale import uses_loss_scale
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.quantize import WeightFormat
from fblc.passes.align_widths import AlignWidths
from fblc.passes.attach_loss import AttachLoss
from fblc.passes.batch_tile import BatchTile
from fblc.passes.bn_batch_stats import BatchNormBatchStats
from fblc.passes.build_gradients import BuildGradients
from fblc.passes.chunk_loss import ChunkLoss
from fblc.passes.commit_if_finite import CommitIfFinite
from fblc.passes.contracts import check_order
from fblc.passes.classify_initializers import ClassifyInitializers
from fblc.passes.eliminate_noops import EliminateNoops
from fblc.passes.es_gradients import EsGradients
from fblc.passes.es_loop import EsLoop
from fblc.passes.es_noise import EsNoise
from fblc.passes.fix_input_shapes import FixInputShapes
from fblc.passes.fold_constants import FoldConstants
from fblc.passes.fold_pads import FoldPads
from fblc.passes.forward_step import ForwardStep
from fblc.passes.ftd_taxonomy import FtdTaxonomy
from fblc.passes.fuse import FuseKernels
from fblc.passes.fura_s import FuraS
from fblc.passes.index_ranges import IndexRanges
from fblc.passes.infer_shapes import InferShapes
from fblc.passes.kernel_schedules import Decide, KernelSchedules
from fblc.passes.lower_composites import LowerComposites
from fblc.passes.lower_recurrent import LowerRecurrent
from fblc.passes.lower_dft import LowerDft
from fblc.passes.mark_trainable import MarkTrainable
from fblc.passes.memory_floor import MemoryFloor
from fblc.passes.memory_plan import MemoryPlanPass
from fblc.passes.optimizer_step import OptimizerStep
from fblc.passes.recompute import Recompute
from fblc.passes.layout_score import TracedReads
from fblc.passes.rtile_select import LAYOUT_SEARCHES, RTileSelect
from fblc.passes.sg_gradients import SgGradients
from fblc.passes.sg_replay import SgReplay
from fblc.passes.skip_nonfinite import SkipNonfinite
from fblc.passes.sort_scatter_rows import SortScatterRows
from fblc.passes.sort_topk import SortTopK
from fblc.passes.split_resize import SplitResize
from fblc.passes.split_softmax import SplitSoftmax
from fblc.passes.split_views import SplitViews
from fblc.passes.storage_precision import StoragePrecision
from fblc.passes.tie_weights import TieWeights
from fblc.passes.pointwise_transposes import PointwiseTransposes
from fblc.passes.pick_log_probs import PickLogProbs
from fblc.passes.quantize_weights import QuantizeWeights
from fblc.passes.tile_remap import TileRemap
from fblc.profiles import Profile
from fblc.profiles.profile import WRITTEN_WEIGHT_GRADIENT_REDUCTION


@dataclass(frozen=True)
class TrainingOptions:
    input_shapes: Mapping[str, Sequence[int]] = field(default_factory=dict)
    loss: str = "cross_entropy"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: str | None = None
    freeze: str | None = None
    bn_train: bool = False
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    #: "backprop" (autodiff), "es" (evolution strategies: forwards only, fblc.compiler.es) or "none" (the forward
    #: alone, for inference: pass forward_step)
    trainer: str = "backprop"
    es: EsConfig = field(default_factory=EsConfig)
    #: batch_tile's limit on one activation in bytes: -1 auto (8 MB with an adapter, else off), 0 off
    tile_bytes: int = -1
    #: texel layouts: "rtile" (R-Tile layouts, data movement remapped) or "naive" (flat, explicit copies)
    layout: str = "rtile"
    #: under rtile, how rtile_select ranks a tensor's candidate layouts (LAYOUT_SEARCHES); kernels,
    #: register tiles and remapping stay as they are, so `blocks` and `flat` ablate the score alone
    layout_search: str = "blocks"
    #: layout_search "traced": the texels the step's kernels read, by tensor (fblc.tools.traced_layouts)
    traced_reads: TracedReads | None = field(default=None, compare=False, repr=False)
    #: device storage of float tensors: "fp32", or "fp16" (mixed precision: half activations, fp32
    #: parameters, gradients and optimizer state; storage_precision)
    dtype: str = "fp32"
    #: "auto" (dynamic under --dtype fp16 with backpropagation), "dynamic" or "none" (fblc.compiler.loss_scale)
    loss_scale: str = "auto"
    #: --weights / --weight-group: the frozen contraction weights' storage (passes/quantize_weights.py)
    weights: WeightFormat = field(default_factory=WeightFormat)
    #: chunk_loss: the cross-entropy over vocabulary chunks of this many columns; -1 auto (8192 where the
    #: vocabulary has >= 16384 classes), 0 off
    loss_chunk: int = -1
    #: --device-memory in bytes: recompute picks layers to recompute in the backward until the live peak fits;
    #: the memory plan checks it (0: no budget)
    device_memory: int = 0
    #: the live peak pass recompute aims at (0: device_memory); fblc compile lowers it when the lowered plan
    #: kept more live than recompute's node-order estimate (codegen/compile.py)
    recompute_target: int = 0


LAYOUTS = ("rtile", "naive")


AUTO_TILE_BYTES = 8_000_000


def tile_bytes(options: TrainingOptions) -> int:
    if options.tile_bytes >= 0:
        return options.tile_bytes
    return AUTO_TILE_BYTES if options.adapter.kind in MEMORY_FLOOR_ADAPTERS else 0


def import_passes(options: TrainingOptions) -> list[ir.passes.PassBase]:
    return [
        FixInputShapes(options.input_shapes),
        ClassifyInitializers(),
        TieWeights(),
        FoldConstants(),
        EliminateNoops(),
        LowerComposites(),
        LowerRecurrent(),
        LowerDft(),
        FoldPads(),
        InferShapes(),
        IndexRanges(),
    ]


def loss_scaled(options: TrainingOptions) -> bool:
    """Whether the step scales its loss (fblc.compiler.loss_scale): --loss-scale dynamic, or auto under fp16."""
    scaled = uses_loss_scale(options.loss_scale, options.dtype, options.trainer)
    if scaled and options.adapter.trains_projection_by_replay:
        if options.loss_scale == "dynamic":
            raise FblcError("--loss-scale dynamic does not combine with --adapter memflora-sg, whose replay "
                            "reads the backward's gradients unscaled", "use --loss-scale none, or another adapter")
        return False  # auto: memflora-sg trains in fp16 without a loss scale
    return scaled


def _gradient_pass(options: TrainingOptions) -> ir.passes.PassBase:
    if options.trainer not in TRAINERS:
        raise FblcError(f"unknown trainer '{options.trainer}'", f"choose one of: {', '.join(TRAINERS + (FORWARD,))}")
    if options.trainer == "es":
        if options.adapter.trains_projection_by_replay:
            raise FblcError("--adapter memflora-sg trains its projection from the backward's gradients, which "
                            "--trainer es does not compute", "use --adapter fura-s, lora or memflora with --trainer es")
        return EsGradients(options.es)
    if options.adapter.trains_projection_by_replay:
        return SgGradients()
    return BuildGradients(loss_scale=loss_scaled(options))


def _chunked_loss(options: TrainingOptions, before_gradients: bool) -> list[ir.passes.PassBase]:
    """chunk_loss where the trainer puts it: after backprop's gradient pass (it replaces the head's backward);
    before es_gradients under a --reward that reads the loss alone, so that every member's loss is chunked (the
    ES members copy the chunked forward); none under a reward that reads the logits (accuracy, external)."""
    chunked_before = options.trainer == "es" and options.es.reward in LOSS_ONLY_REWARDS
    wanted = chunked_before if before_gradients else options.trainer == "backprop"
    return [ChunkLoss(options.loss_chunk, options.loss, members=before_gradients)] if wanted else []


#: what a forward step (--trainer none) cannot have: (whether `options` asks for it, the option, why)
FORWARD_REFUSALS: tuple[tuple[Callable[[TrainingOptions], bool], str, str], ...] = (
    (lambda o: o.adapter.trains_projection_by_replay, "--adapter memflora-sg", "a specialist of memflora-sg trains "
     "its projection P too, which a served model shares: serve it merged (fblc export), or train with memflora"),
    (lambda o: o.bn_train, "--bn-train", "the forward normalises with the running statistics; nothing updates them"),
    (lambda o: o.train is not None or o.freeze is not None, "--train/--freeze", "nothing trains in a forward step"),
    (lambda o: o.loss_scale == "dynamic", "--loss-scale dynamic", "a forward has no gradients to scale"),
)


def _step_passes(options: TrainingOptions) -> list[ir.passes.PassBase]:
    """From the trained set to the step's updates: the forward alone under --trainer none (forward_step,
    then quantize_weights), else mark_trainable, the loss, the gradients, the optimizer and their companions."""
    if options.trainer == FORWARD:
        for asks, option, why in FORWARD_REFUSALS:
            if asks(options):
                raise FblcError(f"{option} is given with --trainer none (a forward bundle): {why}",
                                f"drop {option}, or compile a training step (--trainer backprop or es)")
        return [ForwardStep(), QuantizeWeights(options.weights)]
    return [
        MarkTrainable(options.train, options.freeze),
        QuantizeWeights(options.weights),
        AttachLoss(options.loss),
    ] + _chunked_loss(options, before_gradients=True) + [
        _gradient_pass(options),
    ] + _chunked_loss(options, before_gradients=False) + (
        [PickLogProbs()] if options.trainer == "es" else []) + [
        OptimizerStep(options.optimizer),
    ] + ([SgReplay()] if options.adapter.trains_projection_by_replay else []) + (
        [SkipNonfinite()] if loss_scaled(options) else []) + (
        [Recompute(options.recompute_target or options.device_memory)]
        if options.trainer == "backprop" and options.device_memory > 0 else [])


def training_passes(options: TrainingOptions) -> list[ir.passes.PassBase]:
    return [
        BatchNormBatchStats(options.bn_train),
        MemoryFloor(options.adapter, options.bn_train),
        FuraS(options.adapter, options.weights),
        BatchTile(tile_bytes(options)),
    ] + ([AlignWidths()] if options.layout == "rtile" else []) + _step_passes(options)


PassHook = Callable[[int, ir.passes.PassBase, ir.Model], None]


class _Observed(ir.passes.InPlacePass):
    """`inner`, then `hook(index, inner, model)`: the dumps and the progress display see every pass."""

    def __init__(self, inner: ir.passes.PassBase, index: int, hook: PassHook | None) -> None:
        super().__init__()
        self.inner, self.index, self.hook = inner, index, hook

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = self.inner(model)  # the inner pass's requires / call / ensures
        if self.hook is not None:
            self.hook(self.index, self.inner, result.model)
        return result


def _raised_by_the_pass(error: BaseException) -> BaseException:
    """The exception a pass raised, under the PassErrors that onnx_ir's PassManager wraps it in: a
    user error (FblcError) must reach the CLI as itself."""
    while isinstance(error, ir.passes.PassError) and error.__cause__ is not None:
        error = error.__cause__
    return error


def run_passes(model: ir.Model, passes: Sequence[ir.passes.PassBase], first_index: int = 0,
               after_each: PassHook | None = None) -> ir.Model:
    """Run `passes` in order under onnx_ir's PassManager (each pass checks its contract as it runs,
    fblc.passes.contracts); `after_each(index, pass, model)` sees every intermediate model."""
    if not passes:
        return model
    manager = ir.passes.PassManager([_Observed(p, first_index + i, after_each) for i, p in enumerate(passes)])
    try:
        return manager(model).model
    except ir.passes.PassError as wrapped:
        raise _raised_by_the_pass(wrapped) from None


def dump_hook(directory: str) -> PassHook:
    """Write `directory/NN_<pass>.onnx` after each pass, for Netron."""
    os.makedirs(directory, exist_ok=True)

    def write(index: int, graph_pass: ir.passes.PassBase, model: ir.Model) -> None:
        name = getattr(graph_pass, "name", type(graph_pass).__name__)
        save_model_atomically(model, os.path.join(directory, f"{index:02d}_{name}.onnx"))

    return write


def build_training_graph(model: ir.Model, options: TrainingOptions, dump_dir: str | None = None,
                         on_pass: PassHook | None = None, lower: Profile | None = None,
                         schedules: Decide | None = None) -> ir.Model:
    """Import passes, then training passes: the model becomes one training step.

    `on_pass(index, pass, model)` runs after each pass (progress display); with `dump_dir`
    every intermediate model is also written there. With `lower` (the target's profile), the
    lowering passes run too, with the kernels' `schedules` (kernel_schedules) where given.
    """
    hooks = [h for h in (dump_hook(dump_dir) if dump_dir else None, on_pass) if h is not None]

    def after_each(index: int, graph_pass: ir.passes.PassBase, result: ir.Model) -> None:
        for hook in hooks:
            hook(index, graph_pass, result)

    passes = compile_pipeline(options, lower, schedules) if lower is not None else training_pipeline(options)
    check_order(passes)
    return run_passes(model, passes, after_each=after_each)


def training_pipeline(options: TrainingOptions) -> list[ir.passes.PassBase]:
    return import_passes(options) + training_passes(options)


#: ops that lowering passes write and onnxruntime lacks (es_noise, sort_scatter_rows): a lowered step holding
#: one is checked against the step graph before lowering (fblc.tools.verify.reference_graph)
DEVICE_ONLY_OPS = ops.ops_where(lambda entry: entry.no_gradient == ops.DEVICE_ONLY)


def layout_passes(options: TrainingOptions, cpu: bool = False) -> list[ir.passes.PassBase]:
    """After the step graph is built, the target-independent part: the ops kernels run, their
    FTD classes, data movement as index maps (rtile). `cpu` (the target profile's `cpu` figure): a conv
    weight gradient over a short reduction (WRITTEN_WEIGHT_GRADIENT_REDUCTION) is written in W's own order
    by its conv, whose kernel W's update joins (on PoCL the update then reads no gradient across texels);
    a GPU target keeps its channel tile, its half arithmetic under fp16 and its whole-texel fetches
    (benchmarks/phone_kernels.py)."""
    written = WRITTEN_WEIGHT_GRADIENT_REDUCTION if cpu else 0
    if options.layout not in LAYOUTS:
        raise FblcError(f"unknown layout '{options.layout}'", f"choose one of: {', '.join(LAYOUTS)}")
    if options.layout_search not in LAYOUT_SEARCHES:
        raise FblcError(f"unknown layout search '{options.layout_search}'",
                        f"choose one of: {', '.join(LAYOUT_SEARCHES)}")
    remap = ([SplitViews(), TileRemap(written_reduction=written)] if options.layout == "rtile"
             else [TileRemap(remap=False, written_reduction=written)])
    return [CommitIfFinite(), EsNoise(), SplitSoftmax(), SplitResize(), SortScatterRows(), SortTopK(),
            PointwiseTransposes(), FtdTaxonomy()] + remap


def lowering_passes(options: TrainingOptions, profile: Profile, schedules: Decide | None = None
                    ) -> list[ir.passes.PassBase]:
    """After the step graph is built: layouts for the target, kernels, their schedules (the code
    generator's decisions, `schedules`, when the caller hands them in: kernel_schedules), memory."""
    return layout_passes(options, profile.cpu) + [RTileSelect(profile, options.layout, options.layout_search,
                                                  options.traced_reads), EsLoop(), FuseKernels(), StoragePrecision(options.dtype),
                                     KernelSchedules(schedules), MemoryPlanPass()]


def compile_pipeline(options: TrainingOptions, profile: Profile, schedules: Decide | None = None
                     ) -> list[ir.passes.PassBase]:
    """The training pipeline, then lowering; ES members as one forward that the kernel plan's loop repeats
    (fblc.compiler.es_loop), where `training_pipeline` alone (the ONNX step onnxruntime checks) unrolls them."""
    looped = dataclasses.replace(options, es=dataclasses.replace(options.es, loop=True))
    return training_pipeline(looped) + lowering_passes(options, profile, schedules)
