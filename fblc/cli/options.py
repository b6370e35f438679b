"""Options shared by the commands that build a training step, and their parsing."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from fblc import choices
from fblc.errors import FblcError

if TYPE_CHECKING:
    from fblc.compiler.quantize import WeightFormat


def parse_dims(text: str) -> tuple[str, tuple[int, ...]]:
    """`NAME=1x3x224x224` -> ("NAME", (1, 3, 224, 224)); the name may itself contain '='."""
    name, sep, dims = text.rpartition("=")
    try:
        sizes = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        sizes = ()
    if not sep or not name or not sizes or any(d <= 0 for d in sizes):
        raise argparse.ArgumentTypeError(f"'{text}' is not NAME=DIMS with positive sizes, e.g. input_ids=2x128")
    return name, sizes


def add_training_options(parser: argparse.ArgumentParser, step: bool = True) -> None:
    """Options shared by every command that builds a training step (train-graph, compile, verify).

    `step=False` is `fblc check`'s set: it leaves out what only changes the step's arithmetic, not
    which ops it has (the optimizer's figures, --seed, --dump-dir), and the ES trainer's options:
    check covers the backprop step only. The choices come from fblc.choices, which imports nothing:
    the parser of every command is built for `--help` and every argument error."""
    parser.add_argument("model", help="ONNX model file (torch.onnx.export output or any opset >= 13 model)")
    parser.add_argument("--input-shape", action="append", type=parse_dims, default=[], metavar="NAME=DIMS",
                        help="static shape of a model input, e.g. input_ids=2x128 (repeat per input); "
                             "required for every dynamic dim")
    parser.add_argument("--loss", choices=sorted(choices.LOSSES), default="cross_entropy",
                        help="; ".join(f"{k}: {v}" for k, v in choices.LOSSES.items()) + " (default: cross_entropy)")
    parser.add_argument("--loss-chunk", type=int, default=-1, metavar="COLUMNS",
                        help="cross_entropy over a MatMul's logits in vocabulary chunks of COLUMNS classes, forward "
                             "and backward (ES: every member's loss, under --reward neg-loss), so the [tokens, "
                             "vocabulary] logits never exist whole (0: off; default -1: "
                             "chunks of 8192 where the vocabulary has 16384 classes or more)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="MB",
                        help="the device memory the step may use, in MB (1e6 bytes): where its live peak is larger, "
                             "layers of the forward are recomputed in the backward (checkpointing), the layers that "
                             "free the most saved bytes per FLOP first; the compile fails, naming what it reached, "
                             "where that is not enough (default: no budget)")
    # default None, not sgd: an --optimizer the user gave with --trainer es is refused (check_values)
    parser.add_argument("--optimizer", choices=sorted(choices.OPTIMIZERS), default=None,
                        help="the optimizer of --trainer backprop (ES has --es-optimizer) (default: sgd)")
    if step:
        parser.add_argument("--lr", type=float, default=None,
                            help=f"learning rate (default: {choices.LR:g}; under --trainer es with --es-optimizer "
                                 f"sgd: {choices.ES_SGD_LR:g}, the step alpha, {choices.ES_SOURCE})")
        parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default: 0)")
        parser.add_argument("--weight-decay", type=float, default=0.0,
                            help="L2 penalty for sgd/adam, decoupled decay for adamw (default: 0)")
        parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"),
                            help="Adam betas (default: 0.9 0.999)")
        parser.add_argument("--eps", type=float, default=1e-8, help="Adam epsilon (default: 1e-8)")
        parser.add_argument("--loss-scale", choices=choices.LOSS_SCALES, default="auto",
                            help="dynamic: the backward starts from a scale that keeps half-precision gradients "
                                 "above underflow; a step with inf/NaN gradients is skipped and halves it "
                                 "(reported as 'skipped' and 'scale' per step); auto: dynamic with --dtype fp16, "
                                 "else none (default: auto)")
    parser.add_argument("--train", metavar="REGEX", help="train only parameters whose name matches REGEX")
    parser.add_argument("--freeze", metavar="REGEX", help="freeze parameters whose name matches REGEX")
    parser.add_argument("--bn-train", action="store_true",
                        help="BatchNormalization uses batch statistics (full fine-tuning); default: eval mode")
    if step:
        parser.add_argument("--dump-dir", metavar="DIR",
                            help="write DIR/NN_<pass>.onnx after every pass (open in Netron)")
    add_adapter_options(parser, seed=step)
    if step:
        add_trainer_options(parser)


def add_storage_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", choices=choices.STORAGES, default="auto",
                        help="how a local device holds the textures: image (image2d_t, as on a phone), buffer (the "
                             "same texels row by row in buffers: several times faster on a CPU's OpenCL, such as "
                             "PoCL, whose images are software) or auto: buffer on a CPU device, else image "
                             "(default: auto; a phone always holds images)")


def add_trainer_options(parser: argparse.ArgumentParser) -> None:
    """--trainer and the options of evolution strategies (fblc/compiler/es.py)."""
    group = parser.add_argument_group("forward-only training (--trainer es)")
    group.add_argument("--trainer", choices=choices.TRAINER_CHOICES, default="backprop",
                       help="backprop: gradients by autodiff; es: evolution strategies, 2 x --pairs perturbed "
                            "forwards per step and no backward (with --adapter fura-s: MobileSpec's FuRA-S); none: "
                            "a forward bundle for inference (the model's outputs, no loss, labels or optimizer: "
                            "fblc run BUNDLE --infer) (default: backprop)")
    group.add_argument("--pairs", type=int, default=None,
                       help=f"ES: antithetic perturbation pairs per step "
                            f"(default: {choices.ES_PAIRS}, {choices.ES_SOURCE})")
    group.add_argument("--sigma", type=float, default=None,
                       help=f"ES: perturbation size, relative to the singular values under fura-s "
                            f"(default: {choices.ES_SIGMA:g}, mu_rel of {choices.ES_SOURCE})")
    group.add_argument("--reward", choices=choices.REWARDS, default=None,
                       help="ES: neg-loss (minus each member's loss), accuracy (arg-max hits; class labels) or "
                            "external (the application scores each member's output: "
                            f"fblc.runtime.LocalRunner.step(feeds, reward=fn)) (default: {choices.ES_REWARD})")
    group.add_argument("--es-optimizer", choices=choices.ES_OPTIMIZERS, default=None,
                       help="ES: sgd moves by lr * sigma * the z-scored direction (ES at Scale); adam is ZO-Adam on "
                            "the same estimate (default: sgd)")


def add_adapter_options(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """--adapter/--rank/--adapter-sites/...: the adapters (MemFLoRA, LoRA, FuRA-S; fblc/compiler/adapters.py);
    `seed=False` leaves out --seed, which draws the adapter's values but changes none of its ops."""
    parser.add_argument("--adapter", choices=choices.ADAPTERS, default="none",
                        help="none: train the model's own weights (full fine-tuning); lora: a low-rank branch with "
                             "both factors trainable at every Conv (groups 1), or, in a model without one, at every "
                             "MatMul/Gemm with a constant weight (y = x W + (x A) B; see --adapter-sites); memflora: "
                             "MemFLoRA's memory-floor adapter (frozen projection P, trainable U, backbone frozen, "
                             "1-bit masks); memflora-sg: memflora that also trains P by replaying the forward; "
                             "fura-s: only the block singular values of every MatMul/Gemm weight train (MobileSpec; "
                             "for --trainer es) (default: none)")
    # default None, not 2: a --rank the user gave with --adapter none is refused (check_values)
    parser.add_argument("--rank", type=int, default=None, help=f"adapter rank r (default: {choices.DEFAULT_RANK})")
    if seed:
        parser.add_argument("--seed", type=int, default=0,
                            help="seed of the adapter's random projection P and of ES's noise (default: 0)")
    parser.add_argument("--tile-mb", type=float, default=None, metavar="MB",
                        help="run the network's front in batch chunks so that no activation exceeds MB megabytes "
                             "(0: off; default: 8 with an adapter, off without)")
    parser.add_argument("--adapter-sites", choices=choices.ADAPTER_SITES, default="auto",
                        help="convs that get an adapter: all (groups 1), pointwise (1x1 only), auto: pointwise in "
                             "a network with depthwise convs, else all, and for lora the MatMul/Gemm layers when "
                             "no conv is chosen; linear: lora at the MatMul/Gemm layers only (default: auto)")
    parser.add_argument("--block", type=int, default=None,
                        help="fura-s: column-block width B of the block SVDs; layers whose input features B does "
                             "not divide are skipped (default: the largest power of two <= "
                             f"{choices.WIDEST_CHOSEN_BLOCK} that divides every layer's input features)")
    parser.add_argument("--fura-sites", metavar="REGEX", default=None,
                        help="fura-s: the MatMul/Gemm nodes or weights to adapt (default: every one whose input "
                             "features the block divides)")


def add_strategy_options(parser: argparse.ArgumentParser) -> None:
    """A fleet's aggregation on Flower (fblc fleet simulate and serve): the strategy and its figures."""
    parser.add_argument("--strategy", default="fedavg", choices=["fedavg", "fedprox", "fedadam"],
                        help="Flower's aggregation (default fedavg, weighted by examples)")
    parser.add_argument("--proximal-mu", type=float, default=0.01, help="fedprox: mu (default 0.01)")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="fedprox: the clients' learning rate for the proximal step (the bundle's --lr; "
                             "default 0.1)")
    parser.add_argument("--eta", type=float, default=0.01, help="fedadam: the server's learning rate")


def training_options(args: argparse.Namespace) -> "object":
    from fblc.compiler.optimizers import OptimizerConfig
    from fblc.passes.pipeline import TrainingOptions

    shapes: dict[str, tuple[int, ...]] = {}
    for name, dims in args.input_shape:
        if name in shapes:
            raise FblcError(f"--input-shape given twice for '{name}'", "give each input once")
        shapes[name] = dims
    # a command without the optimizer's figures (check) gets OptimizerConfig's defaults: same ops
    figures = {"lr": getattr(args, "lr", None), "momentum": getattr(args, "momentum", None),
               "weight_decay": getattr(args, "weight_decay", None), "eps": getattr(args, "eps", None)}
    betas = getattr(args, "betas", None)
    if betas is not None:
        figures.update(beta1=betas[0], beta2=betas[1])
    trainer = getattr(args, "trainer", "backprop")
    optimizer_name = (getattr(args, "es_optimizer", None) if trainer == "es" else args.optimizer) or "sgd"
    if figures["lr"] is None and trainer == "es" and optimizer_name == "sgd":
        figures["lr"] = choices.ES_SGD_LR  # MobileSpec's alpha: ES at Scale's update moves by lr * sigma * direction
    optimizer = OptimizerConfig(name=optimizer_name, **{k: v for k, v in figures.items() if v is not None})
    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.es import EsConfig

    rank, block = getattr(args, "rank", None), getattr(args, "block", None)
    adapter = AdapterConfig(kind=getattr(args, "adapter", "none"), rank=choices.DEFAULT_RANK if rank is None else rank,
                            seed=getattr(args, "seed", 0), sites=getattr(args, "adapter_sites", "auto"),
                            block=block,
                            fura_sites=getattr(args, "fura_sites", None))
    adapter.validate()
    es_figures = {"pairs": getattr(args, "pairs", None), "sigma": getattr(args, "sigma", None),
                  "reward": getattr(args, "reward", None)}
    es = EsConfig(seed=getattr(args, "seed", 0), **{k: v for k, v in es_figures.items() if v is not None})
    if trainer == "es":
        es.validate()
    tile_mb = getattr(args, "tile_mb", None)
    return TrainingOptions(input_shapes=shapes, loss=args.loss, optimizer=optimizer, train=args.train,
                           freeze=args.freeze, bn_train=args.bn_train, adapter=adapter, trainer=trainer, es=es,
                           tile_bytes=-1 if tile_mb is None else int(tile_mb * 1e6),
                           layout=getattr(args, "layout", "rtile"),
                           layout_search=getattr(args, "layout_search", "blocks"),
                           dtype=getattr(args, "dtype", "fp32"), loss_scale=getattr(args, "loss_scale", "auto"),
                           weights=weight_format(args),
                           loss_chunk=getattr(args, "loss_chunk", -1),
                           device_memory=int((getattr(args, "device_memory", None) or 0) * 1e6))


def weight_format(args: argparse.Namespace) -> "WeightFormat":
    """--weights and --weight-group (a command without them: fp32, the model's own weights)."""
    from fblc.compiler.quantize import DEFAULT_GROUP, WeightFormat

    weights = WeightFormat(getattr(args, "weights", "fp32"), getattr(args, "weight_group", DEFAULT_GROUP))
    weights.validate()
    return weights


@dataclass(frozen=True)
class Limit:
    """What a numeric option must be; `valid` sees each of its values (both of --betas)."""

    option: str
    valid: Callable[[float], bool]
    must_be: str
    remedy: str


def _finite_at_least(low: float) -> Callable[[float], bool]:
    return lambda value: math.isfinite(value) and value >= low  # NaN fails every comparison, so it fails here


#: every numeric option of every command, by argparse attribute; a command without the option skips it.
#: They are checked before any work: a NaN learning rate would otherwise train for hours on NaN weights.
LIMITS: dict[str, Limit] = {
    "lr": Limit("--lr", _finite_at_least(0.0), "is not a finite learning rate >= 0", "give e.g. --lr 0.01"),
    "momentum": Limit("--momentum", _finite_at_least(0.0), "is not a finite momentum >= 0",
                      "give e.g. --momentum 0.9, or 0 for none"),
    "weight_decay": Limit("--weight-decay", _finite_at_least(0.0), "is not a finite weight decay >= 0",
                          "give e.g. --weight-decay 0.01, or 0 for none"),
    "betas": Limit("--betas", lambda value: 0.0 <= value < 1.0, "has a beta outside [0, 1)",
                   "give two numbers in [0, 1), e.g. --betas 0.9 0.999"),
    "eps": Limit("--eps", lambda value: math.isfinite(value) and value > 0.0, "is not a finite epsilon > 0",
                 "give e.g. --eps 1e-8"),
    "tile_mb": Limit("--tile-mb", _finite_at_least(0.0), "is not a finite size >= 0",
                     "give a size in MB, or 0 to turn batch tiling off"),
    "loss_chunk": Limit("--loss-chunk", lambda value: value >= -1, "is not a number of columns >= 0 (or -1: auto)",
                        "give e.g. --loss-chunk 8192, or 0 to compute the loss over the whole vocabulary"),
    "device_memory": Limit("--device-memory", lambda value: math.isfinite(value) and value > 0.0,
                           "is not a size in MB > 0",
                           "give e.g. --device-memory 1000 (MB), or leave it out for no budget"),
    "rank": Limit("--rank", lambda value: value >= 1, "is not a positive rank",
                  "use --rank 1 or more (the paper uses 2, 4, 8)"),
    "block": Limit("--block", lambda value: value >= 1, "is not a positive block width", "use e.g. --block 64"),
    "pairs": Limit("--pairs", lambda value: value >= 1, "is not a number of antithetic pairs >= 1",
                   "give e.g. --pairs 15 (the paper's)"),
    "sigma": Limit("--sigma", lambda value: math.isfinite(value) and value > 0.0, "is not a perturbation > 0",
                   "give e.g. --sigma 0.03 (the paper's)"),
    "seed": Limit("--seed", lambda value: value >= 0, "is not a seed >= 0", "give e.g. --seed 0"),
    "steps": Limit("--steps", lambda value: value >= 1, "is not a number of steps >= 1", "give e.g. --steps 10"),
    "show": Limit("--show", lambda value: value >= 0, "is not a number of rows >= 0", "give e.g. --show 15"),
}


def _shown(value: Any) -> str:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def check_values(args: argparse.Namespace) -> None:
    """Refuse a bad option value with one FblcError that names it, before the command does any work."""
    for attribute, limit in LIMITS.items():
        value = getattr(args, attribute, None)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if not all(isinstance(v, (int, float)) for v in values):  # unset, or not a number (profile --show FILE)
            continue
        if not all(limit.valid(v) for v in values):
            raise FblcError(f"{limit.option} {_shown(value)} {limit.must_be}", limit.remedy)
    adapter = getattr(args, "adapter", None)
    if adapter in ("none", "fura-s") and getattr(args, "rank", None) is not None:
        raise FblcError(f"--rank {args.rank} is given with --adapter {adapter}, which has no rank",
                        "add --adapter lora, memflora or memflora-sg, or drop --rank")
    for option, attribute in (("--block", "block"), ("--fura-sites", "fura_sites")):
        if adapter is not None and adapter != "fura-s" and getattr(args, attribute, None) is not None:
            raise FblcError(f"{option} is given with --adapter {adapter}", f"add --adapter fura-s, or drop {option}")
    if getattr(args, "trainer", "backprop") == "es" and getattr(args, "optimizer", None) is not None:
        raise FblcError("--optimizer is for --trainer backprop", "under es use --es-optimizer")  # was ignored
    if getattr(args, "trainer", "backprop") == choices.FORWARD:  # a forward bundle has no optimizer to tune
        for option in ("optimizer", "lr"):  # the others have non-None defaults
            if getattr(args, option, None) is not None:
                flag = "--" + option.replace("_", "-")
                raise FblcError(f"{flag} is given with --trainer none (a forward bundle), which has no optimizer",
                                f"drop {flag}, or compile a training step (--trainer backprop or es)")
    if getattr(args, "trainer", "backprop") != "es":
        for option in ("pairs", "sigma", "reward", "es_optimizer"):
            if getattr(args, option, None) is not None:
                flag = "--" + option.replace("_", "-")
                raise FblcError(f"{flag} is an option of --trainer es", f"add --trainer es, or drop {flag}")


@contextlib.contextmanager
def pass_progress(total: int, enabled: bool) -> Iterator[Callable[..., None] | None]:
    """A transient progress bar on stderr that advances once per pass (only on a terminal)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), transient=True) as progress:
        task = progress.add_task("passes", total=total)

        def advance(index: int, graph_pass: object, model: object) -> None:
            progress.update(task, advance=1, description=f"pass {getattr(graph_pass, 'name', '')}")

        yield advance
