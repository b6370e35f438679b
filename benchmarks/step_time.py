"""Median training-step time: fblc's OpenCL bundle on the local device vs a PyTorch eager step, same model and batch.

    python benchmarks/step_time.py [--steps 5] [--models mlp,tresnet,mobilenet_v2,resnet,llama]

Both sides run forward, cross-entropy loss, backward and AdamW on this CPU: fblc through its
kernels on PoCL (the local OpenCL device), PyTorch eagerly with its own threads. The table
gives the median of `--steps` steps after one warm-up step, and fblc's time over PyTorch's. The
sides take their steps in turn, round by round (interleaved_ms), so each ratio compares the same
minutes of a shared machine, whose speed drifts.
A benchmark, not a test: no threshold. fblc's kernels read image2d textures, which PoCL serves
through a library call per texel read that also keeps its compiler from vectorising a kernel across
work-items; PyTorch runs oneDNN's vectorised convolutions and GEMMs on the same cores. So the same
bundle runs twice: with image2d_t textures, as on a phone, and with LocalRunner's storage "buffer"
(the same kernels, each texture's texels in index order in a __global buffer), the form a CPU's
OpenCL runs fast.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402
from tests.support import models  # noqa: E402

Case = tuple[str, torch.nn.Module, dict[str, np.ndarray], np.ndarray, Callable[[torch.nn.Module], torch.Tensor]]


def _classification(name: str, path: str, module: torch.nn.Module, x: np.ndarray, classes: int,
                    input_name: str = "x") -> Case:
    labels = np.random.default_rng(1).integers(0, classes, x.shape[0]).astype(np.int64)
    tensor, target = torch.from_numpy(x), torch.from_numpy(labels)
    return (name, module, {input_name: x, "path": path}, labels,
            lambda m: torch.nn.functional.cross_entropy(m(tensor), target))


def build_cases(directory: str, names: list[str]) -> list[Case]:
    rng = np.random.default_rng(0)
    cases = []
    if "mlp" in names:
        path = models._example("mlp")(os.path.join(directory, "mlp.onnx"), batch=64, in_features=256,
                                      hidden=(512, 512), classes=10)
        cases.append(_classification("mlp B=64", path, models.TorchMLP.from_onnx(path),
                                     rng.standard_normal((64, 256)).astype(np.float32), 10))
    if "tresnet" in names:
        path = models._example("tresnet")(os.path.join(directory, "tresnet.onnx"), batch=64)
        cases.append(_classification("t-resnet B=64", path, models.TorchTResNet.from_onnx(path),
                                     rng.standard_normal((64, 97, 60, 1)).astype(np.float32), 17))
    if "mobilenet_v2" in names:
        x = rng.standard_normal((8, 3, 97, 60)).astype(np.float32)
        path = os.path.join(directory, "mobilenet_v2.onnx")
        module = models.export_mobilenet_v2(path, x, num_labels=17, image_size=97)
        cases.append(_classification("mobilenetv2 [8,3,97,60]", path, module, x, 17, "pixel_values"))
    if "resnet" in names:  # a MaxPool stem (7x7 conv, 3x3 pool): its backward was quadratic until the gather form
        import transformers

        torch.manual_seed(0)
        module = models.logits_only(transformers.ResNetForImageClassification(transformers.ResNetConfig(
            num_labels=10, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])), "pixel_values").eval()
        x = rng.standard_normal((4, 3, 64, 64)).astype(np.float32)
        path = os.path.join(directory, "resnet.onnx")
        models._quiet_dynamo_export(module, (torch.from_numpy(x),)).save(path)
        cases.append(_classification("resnet stem [4,3,64,64]", path, module, x, 10, "pixel_values"))
    if "llama" in names:
        exported, _ = models.llama(directory)
        ids = exported.inputs["input_ids"]
        cases.append(("llama 2L B=2 T=16", exported.module, {"input_ids": ids, "path": exported.path},
                      exported.labels, exported.loss_of))
    return cases


def torch_stepper(module: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> Callable[[], None]:
    """One PyTorch eager training step of `module` (AdamW) per call."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=1e-2)

    def step() -> None:
        optimizer.zero_grad()
        loss_of(module).backward()
        optimizer.step()
    return step


def interleaved_ms(steppers: dict[str, Callable[[], object]], steps: int, settle: bool = True) -> dict[str, float]:
    """The median ms of each of `steppers` over `steps` rounds, after a warm-up call of each (the OpenCL
    JIT, PyTorch's first allocations). Each round gives every stepper its turn, so a drift in a shared
    machine's speed reaches every side alike (this one's moved 30 % between runs). With `settle` a turn
    is two calls and times the second: the previous side's worker threads still spin a while after it
    returns (PyTorch's OpenMP pool; only needed where the sides use different thread pools)."""
    for step in steppers.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(steps):
        for name, step in steppers.items():
            if settle:
                step()
            started = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def torch_step_ms(module: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor], steps: int) -> float:
    return interleaved_ms({"torch": torch_stepper(module, loss_of)}, steps)["torch"]


def compile_bundle(path: str, bundle: str, layout: str = "rtile", target: str = "local") -> dict:
    """Compile `path`'s AdamW training step into `bundle`; its report."""
    _, report = compile_model(path, bundle, target, "fp32", TrainingOptions(
        loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2), layout=layout))
    return report


def runner_stepper(runner: LocalRunner, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    return lambda: runner.step(feeds)


def fblc_step_ms(path: str, feeds: dict[str, np.ndarray], bundle: str, steps: int, layout: str = "rtile",
                 target: str = "local", storages: Sequence[str] = ("image",)) -> tuple[list[float], dict]:
    """Compile `path` (AdamW) into `bundle`, then run it in each of `storages` (LocalRunner's) on the local
    device, their steps interleaved; the median steps in ms and the report."""
    report = compile_bundle(path, bundle, layout, target)
    medians = interleaved_ms({storage: runner_stepper(LocalRunner(bundle, storage=storage), feeds)
                              for storage in storages}, steps)
    return [medians[storage] for storage in storages], report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="mlp,tresnet,mobilenet_v2,resnet,llama")
    parser.add_argument("--target", default="local", help="the profile the bundles are compiled for (default: local; "
                        "benchmarks/gpu_check.sh runs a phone target's kernels on a GPU)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name, module, inputs, labels, loss_of in build_cases(directory, args.models.split(",")):
            path = inputs.pop("path")
            feeds = {**inputs, "labels": labels}
            bundle = os.path.join(directory, os.path.basename(path) + ".bundle")
            report = compile_bundle(path, bundle, target=args.target)
            ms = interleaved_ms({**{storage: runner_stepper(LocalRunner(bundle, storage=storage), feeds)
                                    for storage in ("image", "buffer")},
                                 "torch": torch_stepper(module.train(False), loss_of)}, args.steps)
            rows.append((name, ms["image"], ms["buffer"], ms["torch"], report["kernels"]))
            print(f"  measured {name}", file=sys.stderr)
    print(f"{'model':<26} {'fblc image ms':>14} {'fblc buffer ms':>15} {'PyTorch ms':>11} {'image / torch':>14} "
          f"{'buffer / torch':>15} {'kernels':>8}")
    for name, image_ms, buffer_ms, torch_ms, kernels in rows:
        print(f"{name:<26} {image_ms:14.1f} {buffer_ms:15.1f} {torch_ms:11.1f} {image_ms / torch_ms:14.2f} "
              f"{buffer_ms / torch_ms:15.2f} {kernels:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
