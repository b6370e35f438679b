"""Options shared by the commands that build a training step, and their parsing."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, Iterator

from fblc.compiler.errors import FblcError


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


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds a training step (train-graph, compile, verify)."""
    from fblc.compiler.losses import LOSSES
    from fblc.compiler.optimizers import OPTIMIZERS

    parser.add_argument("model", help="ONNX model file (torch.onnx.export output or any opset >= 13 model)")
    parser.add_argument("--input-shape", action="append", type=parse_dims, default=[], metavar="NAME=DIMS",
                        help="static shape of a model input, e.g. input_ids=2x128 (repeat per input); "
                             "required for every dynamic dim")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="cross_entropy",
                        help="; ".join(f"{k}: {v.help}" for k, v in LOSSES.items()) + " (default: cross_entropy)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd", help="default: sgd")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (default: 0.01)")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default: 0)")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="L2 penalty for sgd/adam, decoupled decay for adamw (default: 0)")
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"),
                        help="Adam betas (default: 0.9 0.999)")
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam epsilon (default: 1e-8)")
    parser.add_argument("--train", metavar="REGEX", help="train only parameters whose name matches REGEX")
    parser.add_argument("--freeze", metavar="REGEX", help="freeze parameters whose name matches REGEX")
    parser.add_argument("--bn-train", action="store_true",
                        help="BatchNormalization uses batch statistics (full fine-tuning); default: eval mode")
    parser.add_argument("--dump-dir", metavar="DIR", help="write DIR/NN_<pass>.onnx after every pass (open in Netron)")
    add_adapter_options(parser)


def add_adapter_options(parser: argparse.ArgumentParser) -> None:
    """--adapter/--rank/--seed/--adapter-sites: the memory-floor adapter (DESIGN.md section 8)."""
    from fblc.compiler.adapters import ADAPTERS, SITE_SELECTIONS

    parser.add_argument("--adapter", choices=ADAPTERS, default="none",
                        help="none: train the model's own weights (full fine-tuning); lora: a low-rank branch with "
                             "both factors trainable at every Conv (groups 1); memflora: MemFLoRA's memory-floor "
                             "adapter (frozen projection P, trainable U, backbone frozen, 1-bit masks); memflora-sg: "
                             "memflora that also trains P by replaying the forward (default: none)")
    parser.add_argument("--rank", type=int, default=2, help="adapter rank r (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the adapter's random projection P (default: 0)")
    parser.add_argument("--tile-mb", type=float, default=None, metavar="MB",
                        help="run the network's front in batch chunks so that no activation exceeds MB megabytes "
                             "(0: off; default: 8 with an adapter, off without)")
    parser.add_argument("--adapter-sites", choices=SITE_SELECTIONS, default="auto",
                        help="convs that get an adapter: all (groups 1), pointwise (1x1 only), auto: pointwise in "
                             "a network with depthwise convs, else all (default: auto)")


def training_options(args: argparse.Namespace) -> "object":
    from fblc.compiler.optimizers import OptimizerConfig
    from fblc.passes.pipeline import TrainingOptions

    shapes: dict[str, tuple[int, ...]] = {}
    for name, dims in args.input_shape:
        if name in shapes:
            raise FblcError(f"--input-shape given twice for '{name}'", "give each input once")
        shapes[name] = dims
    optimizer = OptimizerConfig(name=args.optimizer, lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, beta1=args.betas[0], beta2=args.betas[1],
                                eps=args.eps)
    from fblc.compiler.adapters import AdapterConfig

    adapter = AdapterConfig(kind=getattr(args, "adapter", "none"), rank=getattr(args, "rank", 2),
                            seed=getattr(args, "seed", 0), sites=getattr(args, "adapter_sites", "auto"))
    adapter.validate()
    tile_mb = getattr(args, "tile_mb", None)
    if tile_mb is not None and tile_mb < 0:
        raise FblcError(f"--tile-mb {tile_mb} is negative", "give a size in MB, or 0 to turn batch tiling off")
    return TrainingOptions(input_shapes=shapes, loss=args.loss, optimizer=optimizer, train=args.train,
                           freeze=args.freeze, bn_train=args.bn_train, adapter=adapter,
                           tile_bytes=-1 if tile_mb is None else int(tile_mb * 1e6),
                           layout=getattr(args, "layout", "rtile"))


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
