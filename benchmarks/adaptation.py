"""Adapting pretrained models with fblc: FuRA-S ES against LoRA, full ES, MemFLoRA and backprop.

    python benchmarks/adaptation.py [--quick] [--seeds 3] [--models decoder,digits] [--out runs/adaptation]

Two models are pretrained here with PyTorch on real data that ships with the machine
(benchmarks/adaptation_models.py): a 2-layer byte-level Llama on the Python standard library's
`Lib/*.py`, and a small CNN (two convolutions, two linear layers) on scikit-learn's upright
handwritten digits. Each is exported (torch.onnx.export) and adapted to a task it was not
trained on: the decoder to the language reference's prose (`pydoc_data/topics.py`), the CNN to
other digits rotated by 45 degrees. Every row is an `fblc` bundle (compile_model for the
`local` target, fp32) trained by fblc.runtime.LocalRunner with buffer storage on the local
OpenCL device (PoCL):

    FuRA-S ES      ES over the block singular values of the frozen MatMul/Gemm weights (fura-s, block auto)
    LoRA ES        ES over LoRA adapters (rank 2; Conv sites in the CNN, MatMul/Gemm in the decoder)
    full ES        ES over every weight
    LoRA backprop  LoRA rank 2, Adam
    MemFLoRA       MemFLoRA rank 2, Adam (Conv sites only: n/a for the decoder)
    full backprop  every weight, Adam

Budgets: every row takes the same `--steps` steps over the same shuffled training batches; the
three ES rows use `--pairs` antithetic pairs, so each spends steps x (2 pairs + 1) forward passes
(equal across ES rows); a backprop step is one forward and one backward. ES steps use SGD (ES at
Scale's update, lr = alpha), backprop steps Adam.

Settings: each trainer's sigma and learning rate are chosen by the same sweep, run with seed 0
for `--sweep-steps` steps on the shifted task's training batches and scored by the loss on its
validation split: every ES row tries the grid ES_GRID (sigma x lr; sigma in each trainer's own
units: relative change of singular values for FuRA-S, of weight entries for LoRA ES and full ES),
every backprop row ADAM_LRS. The chosen setting then runs with each seed (the ES noise, the
adapter initialisation and the batch order change with it), and the table prints the held-out
test loss (and accuracy for the digits) before and after, as mean +- standard deviation over the
seeds, the trained values, report.json's planned device peak (memory.device_peak) and, for ES,
the fraction of perturbed members whose loss beats the unperturbed model's on the same batch
(MobileSpec's Figure 4b; from the step's `rewards` output, -loss of each member).

Pretrained models and sweep results are cached in `--out`, keyed by the settings that made
them, so that a rerun with the same settings only runs the seeds. Nothing printed is a constant
of this file: every figure comes from the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.adaptation_models import Task, decoder_task, digits_task  # noqa: E402
from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.compiler.es import NOISE, REWARDS_OUTPUT, EsConfig  # noqa: E402
from fblc.compiler.model_io import load_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.compiler.reference import onnxruntime_session  # noqa: E402
from fblc.errors import FblcError  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, build_training_graph  # noqa: E402
from fblc.paths import write_atomically  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402

RANK = 2


@dataclass(frozen=True)
class Trainer:
    label: str
    trainer: str  # "es" or "backprop"
    adapter: str  # an --adapter kind


TRAINERS = (Trainer("FuRA-S ES", "es", "fura-s"), Trainer("LoRA ES", "es", "lora"), Trainer("full ES", "es", "none"),
            Trainer("LoRA backprop", "backprop", "lora"), Trainer("MemFLoRA", "backprop", "memflora"),
            Trainer("full backprop", "backprop", "none"))


@dataclass(frozen=True)
class Scale:
    """The sizes of a run; QUICK fits a few minutes on two busy cores."""

    decoder_pretrain_steps: int = 4000
    digits_pretrain_steps: int = 2000
    decoder_batch: int = 8
    decoder_length: int = 64
    digits_batch: int = 32
    eval_batches: int = 16  # decoder validation and test batches (the digits: 6 batches of 32 of each 200 images)
    steps: int = 200
    pairs: int = 8
    sweep_steps: int = 60
    es_sigmas: tuple[float, ...] = (0.003, 0.01, 0.03, 0.1, 0.3)
    es_lrs: tuple[float, ...] = (0.3, 1.0, 3.0)
    adam_lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)


QUICK = Scale(decoder_pretrain_steps=1500, digits_pretrain_steps=1000, decoder_length=32, eval_batches=4, steps=40,
              pairs=4, sweep_steps=20, es_sigmas=(0.01, 0.03, 0.1), es_lrs=(1.0,), adam_lrs=(1e-3, 1e-2))


def options(trainer: Trainer, sigma: float | None, lr: float, pairs: int, seed: int) -> TrainingOptions:
    adapter = AdapterConfig(kind=trainer.adapter, rank=RANK, seed=seed)
    if trainer.trainer == "es":
        return TrainingOptions(trainer="es", adapter=adapter, es=EsConfig(pairs=pairs, sigma=sigma, seed=seed),
                               optimizer=OptimizerConfig("sgd", lr=lr))
    return TrainingOptions(adapter=adapter, optimizer=OptimizerConfig("adam", lr=lr))


class Evaluator:
    """Held-out loss (and accuracy) of a step's unperturbed forward on onnxruntime, at given parameters.

    The step graph of the same options (before lowering) with the model's output added to its outputs;
    onnxruntime runs only the nodes the loss and the output need, so no ES member or gradient runs."""

    def __init__(self, task: Task, step_options: TrainingOptions) -> None:
        model = load_model(task.path)
        self.output_name = model.graph.outputs[0].name
        step = build_training_graph(model, step_options)
        produced = {v.name: v for node in step.graph for v in node.outputs}
        if self.output_name not in {v.name for v in step.graph.outputs}:
            step.graph.outputs.append(produced[self.output_name])
        self.session = onnxruntime_session(ir.to_proto(step))
        # parameters are initializers of the step: onnxruntime lists them apart, as overridable
        self.inputs = {i.name for i in [*self.session.get_inputs(), *self.session.get_overridable_initializers()]}
        # an ES step's noise feeds only its members, which the loss and the output do not need
        self.zeros = {i.name: np.zeros(i.shape, np.float32) for i in self.session.get_inputs() if i.name == NOISE}
        self.task = task

    def __call__(self, parameters: dict[str, np.ndarray], split: str) -> tuple[float, float]:
        losses, hits, counted = [], 0, 0
        for inputs, labels in self.task.batches[split]:
            feeds = {self.task.input_name: inputs, "labels": labels, **self.zeros, **parameters}
            loss, output = self.session.run(["loss", self.output_name],
                                            {k: v for k, v in feeds.items() if k in self.inputs})
            losses.append(float(loss))
            hits += int(np.sum(output.argmax(-1) == labels))
            counted += labels.size
        return float(np.mean(losses)), hits / counted if self.task.classifier else float("nan")


_EVALUATORS: dict[tuple[str, str, int], Evaluator] = {}


def evaluator(task: Task, trainer: Trainer, seed: int, step_options: TrainingOptions) -> Evaluator:
    """One Evaluator per task, trainer and seed: sigma and lr change the update, not the forward it evaluates."""
    key = (task.path, trainer.label, seed)
    if key not in _EVALUATORS:
        _EVALUATORS[key] = Evaluator(task, step_options)
    return _EVALUATORS[key]


def adapt(task: Task, trainer: Trainer, sigma: float | None, lr: float, scale: Scale, steps: int, seed: int,
          split: str) -> dict[str, float]:
    """One adaptation run on the device: figures before and after on `split`, trained values, device peak,
    the ES members' beat fraction."""
    step_options = options(trainer, sigma, lr, scale.pairs, seed)
    with tempfile.TemporaryDirectory() as folder:
        bundle = os.path.join(folder, "bundle")
        _, report = compile_model(task.path, bundle, "local", "fp32", step_options)
        runner = LocalRunner(bundle, storage="buffer", progress=False)
        evaluate = evaluator(task, trainer, seed, step_options)
        before = evaluate(runner.parameters(), split)
        train = task.batches["train"]
        order = np.random.default_rng(seed).permutation(len(train))
        beats, started = [], time.perf_counter()
        for k in range(steps):
            inputs, labels = train[order[k % len(train)]]
            loss = runner.step({task.input_name: inputs, "labels": labels})
            if not np.isfinite(loss):
                break
            if trainer.trainer == "es":  # rewards are -loss of each member (--reward neg-loss)
                beats.append(float(np.mean(runner.read(REWARDS_OUTPUT) > -loss)))
        seconds = time.perf_counter() - started
        after = evaluate(runner.parameters(), split)
    return {"loss before": before[0], "loss after": after[0], "accuracy before": before[1],
            "accuracy after": after[1], "values": sum(int(np.prod(t["shape"])) for t in report["trained"]["tensors"]),
            "device peak": report["memory"]["device_peak"], "beat": float(np.mean(beats)) if beats else float("nan"),
            "seconds": seconds}


def grid(trainer: Trainer, scale: Scale) -> list[tuple[float | None, float]]:
    if trainer.trainer == "es":
        return [(sigma, lr) for sigma in scale.es_sigmas for lr in scale.es_lrs]
    return [(None, lr) for lr in scale.adam_lrs]


def sweep(task: Task, trainer: Trainer, scale: Scale, cache: dict) -> dict:
    """The grid's validation losses and the chosen (sigma, lr), from the cache when these settings ran."""
    key = "|".join([task.name, trainer.label, _digest(task.path), json.dumps(dataclasses.asdict(scale))])
    if key not in cache:
        tried = []
        for sigma, lr in grid(trainer, scale):
            result = adapt(task, trainer, sigma, lr, scale, scale.sweep_steps, seed=0, split="val")
            tried.append({"sigma": sigma, "lr": lr, "val loss": result["loss after"]})
            print(f"  sweep {task.name} {trainer.label}: sigma {sigma} lr {lr:g} -> val loss "
                  f"{result['loss after']:.4f}", file=sys.stderr, flush=True)
        finite = [t for t in tried if np.isfinite(t["val loss"])]
        best = min(finite, key=lambda t: t["val loss"]) if finite else tried[0]
        cache[key] = {"tried": tried, "sigma": best["sigma"], "lr": best["lr"]}
    return cache[key]


def setting(chosen: dict, trainer: Trainer, scale: Scale) -> tuple[str, str]:
    """The chosen sigma and lr as printed, `*` marking a value at its grid's edge (a wider sweep may move it)."""
    def mark(value: float | None, tried: tuple[float, ...]) -> str:
        if value is None:
            return "-"
        return f"{value:g}{'*' if len(tried) > 1 and value in (min(tried), max(tried)) else ''}"

    lrs = scale.es_lrs if trainer.trainer == "es" else scale.adam_lrs
    return mark(chosen["sigma"], scale.es_sigmas), mark(chosen["lr"], lrs)


def _digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()[:16]


def spread(values: list[float], digits: int = 4) -> str:
    """Mean +- standard deviation over the seeds; the mean alone where they agree to the digits printed."""
    array = np.asarray(values, dtype=float)
    if np.all(np.isnan(array)):
        return ""
    mean, deviation = f"{np.nanmean(array):.{digits}f}", f"{np.nanstd(array):.{digits}f}"
    return mean if float(deviation) == 0 else f"{mean} +- {deviation}"


def described(pretrained: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                     for key, value in pretrained.items())


def rows_for(task: Task, scale: Scale, seeds: int, cache: dict, save: Callable[[], None]) -> list[str]:
    rows = []
    for trainer in TRAINERS:
        try:
            chosen = sweep(task, trainer, scale, cache)
        except FblcError as error:  # an adapter without a site in this model (MemFLoRA in the decoder)
            rows.append(f"| {task.name} | {trainer.label} | n/a: {error.cause[:90]} |" + " |" * 9)
            continue
        save()
        runs = [adapt(task, trainer, chosen["sigma"], chosen["lr"], scale, scale.steps, seed, "test")
                for seed in range(seeds)]
        forwards = scale.steps * (2 * scale.pairs + 1) if trainer.trainer == "es" else scale.steps
        accuracy = {k: spread([100 * r[k] for r in runs], 1) for k in ("accuracy before", "accuracy after")}
        sigma, lr = setting(chosen, trainer, scale)
        rows.append(f"| {task.name} | {trainer.label} | {sigma} | {lr} | {runs[0]['values']:,} | {forwards:,}"
                    f"{'' if trainer.trainer == 'es' else ' + backward'} | {runs[0]['device peak'] / 1e6:.2f} | "
                    f"{spread([r['loss before'] for r in runs])} | {spread([r['loss after'] for r in runs])} | "
                    f"{accuracy['accuracy before']} | {accuracy['accuracy after']} | "
                    f"{spread([r['beat'] for r in runs], 2)} |")
        print(f"  {task.name} {trainer.label}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (QUICK): shorter pretraining, 40 steps "
                        "of 4 pairs, 3 sigmas and 2 Adam lrs in the sweep; about 5 minutes on two busy cores once "
                        "the models are cached, 8 before (the full run: an hour or more)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row (default 3)")
    parser.add_argument("--models", default="decoder,digits", help="decoder, digits or both, comma-separated")
    parser.add_argument("--out", default="runs/adaptation", help="cache of pretrained models and sweeps")
    args = parser.parse_args(argv)
    models = [name for name in args.models.split(",") if name]
    unknown = [name for name in models if name not in ("decoder", "digits")]
    if unknown or args.seeds < 1:
        parser.error(f"--models {','.join(unknown)}: choose decoder, digits or both" if unknown else
                     f"--seeds {args.seeds}: give 1 or more")
    scale = QUICK if args.quick else Scale()
    os.makedirs(args.out, exist_ok=True)
    cache_path = os.path.join(args.out, "sweeps.json")
    cache = json.load(open(cache_path, encoding="utf-8")) if os.path.exists(cache_path) else {}

    def save() -> None:
        write_atomically(cache_path, lambda out: out.write(json.dumps(cache, indent=1).encode("utf-8")))

    builders = {"decoder": lambda: decoder_task(args.out, scale.decoder_batch, scale.decoder_length,
                                                scale.decoder_pretrain_steps, scale.eval_batches),
                "digits": lambda: digits_task(args.out, scale.digits_batch, scale.digits_pretrain_steps)}
    rows = ["| model | trainer | sigma | lr | trained values | forwards | device peak MB | test loss before | "
            "test loss after | acc. before % | acc. after % | members beating the base |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for name in models:
        task = builders[name]()
        notes.append(f"{name} pretrained (held-out): {described(task.pretrained)}")
        rows += rows_for(task, scale, args.seeds, cache, save)
        save()
    print(f"{'quick' if args.quick else 'full'} run: {scale.steps} steps, ES {scale.pairs} pairs, sweep "
          f"{scale.sweep_steps} steps (seed 0, validation loss) over sigma {scale.es_sigmas} x lr {scale.es_lrs} "
          f"(ES, SGD) and lr {scale.adam_lrs} (backprop, Adam); {args.seeds} seeds, mean +- sd; * a setting at "
          "its grid's edge")
    print("\n".join(notes))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
