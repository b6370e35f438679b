"""The first training step of a bundle on a cold kernel cache and on a warm one, and the second step.

    python benchmarks/first_step.py [--models tresnet,mobilenet_v2,llama] [--target local]

The first run of a bundle compiles its kernels. On PoCL (the local CPU device) that is the
OpenCL C front end over kernels.cl in clBuildProgram (the runner's setup), then the work-group
function of each distinct kernel at its first launch (the first step). PoCL keeps both in its
kernel cache, and pyopencl adds no cache of its own for PoCL. Each model is compiled once, then
stepped in fresh processes, since PoCL reads POCL_CACHE_DIR once per process:

  cold    an empty POCL_CACHE_DIR: the runner's setup and its first step, as the first run pays them
  warm    the same folder, now filled, in a new process: setup and first step, as every later run pays them
  second  the step after the first in the cold process: what every step costs from then on

Models, at the batch of benchmarks/step_time.py: T-ResNet (examples/tresnet.py) B=64, transformers'
MobileNetV2 (17 classes) on [8, 3, 97, 60], the 2-layer Llama decoder of the tests (B=2, T=16);
`resnet` adds the tests' small transformers ResNet. AdamW, cross-entropy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

Case = tuple[str, str, dict[str, np.ndarray]]  # name, ONNX path, feeds


def tresnet_case(directory: str) -> Case:
    from tests.support import models

    path = models._example("tresnet")(os.path.join(directory, "tresnet.onnx"), batch=64)
    rng = np.random.default_rng(0)
    return "t-resnet B=64", path, {"x": rng.standard_normal((64, 97, 60, 1)).astype(np.float32),
                                   "labels": rng.integers(0, 17, 64).astype(np.int64)}


def mobilenet_case(directory: str) -> Case:
    from benchmarks.layout import mobilenet_case as mobilenet_at

    return mobilenet_at(directory, batch=8)


def llama_case(directory: str) -> Case:
    from tests.support import models

    exported, _ = models.llama(directory)
    return "llama 2L B=2 T=16", exported.path, {**exported.inputs, "labels": exported.labels}


def resnet_case(directory: str) -> Case:
    from tests.support import models

    exported = models.resnet_dynamo_optimized(directory)
    return "resnet (tests) [2,3,32,32]", exported.path, {**exported.inputs, "labels": exported.labels}


CASES: dict[str, Callable[[str], Case]] = {"tresnet": tresnet_case, "mobilenet_v2": mobilenet_case,
                                           "llama": llama_case, "resnet": resnet_case}
DEFAULT_MODELS = "tresnet,mobilenet_v2,llama"


def child(bundle: str, feeds_path: str) -> int:
    """In a fresh process: the runner's setup, its first step and its second; JSON on stdout."""
    from fblc.runtime.local import LocalRunner

    said: list[str] = []
    feeds = dict(np.load(feeds_path))
    started = time.perf_counter()
    runner = LocalRunner(bundle, progress=said.append, storage="image")
    setup = time.perf_counter()
    runner.step(feeds)
    first = time.perf_counter()
    runner.step(feeds)
    second = time.perf_counter()
    print(json.dumps({"setup_s": setup - started, "first_s": first - started, "second_s": second - first,
                      "said": said}))
    return 0


def measure(bundle: str, feeds_path: str, cache: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", bundle, feeds_path],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "POCL_CACHE_DIR": cache})
    if done.returncode != 0:
        raise SystemExit(f"the step process failed:\n{done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {', '.join(CASES)} (default: {DEFAULT_MODELS})")
    parser.add_argument("--target", default="local", help="target the bundles are compiled for (default: local)")
    parser.add_argument("--child", nargs=2, metavar=("BUNDLE", "FEEDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    from fblc.codegen.compile import compile_model
    from fblc.compiler.optimizers import OptimizerConfig
    from fblc.passes.pipeline import TrainingOptions

    keys = args.models.split(",")
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(CASES)}")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for key in keys:
            name, path, feeds = CASES[key](directory)
            bundle = os.path.join(directory, f"{key}.bundle")
            compile_model(path, bundle, args.target, "fp32", TrainingOptions(
                loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2)))
            with open(os.path.join(bundle, "plan.json"), encoding="utf-8") as handle:
                launches = json.load(handle)["kernels"]
            feeds_path = os.path.join(directory, f"{key}.npz")
            np.savez(feeds_path, **feeds)
            cache = tempfile.mkdtemp(prefix="pocl-cache-", dir=directory)  # empty: the cold run
            cold = measure(bundle, feeds_path, cache)
            warm = measure(bundle, feeds_path, cache)
            for line in cold["said"]:
                print(f"  {name}: {line}", file=sys.stderr)
            rows.append((name, len({k["function"] for k in launches}), len(launches), cold, warm))
    print(f"{'model':<27} {'kernels':>8} {'launches':>9} {'cold setup s':>13} {'cold first step s':>18} "
          f"{'warm first step s':>18} {'second step s':>14} {'compiling s':>12}")
    for name, kernels, launches, cold, warm in rows:
        print(f"{name:<27} {kernels:8d} {launches:9d} {cold['setup_s']:13.1f} {cold['first_s']:18.1f} "
              f"{warm['first_s']:18.2f} {cold['second_s']:14.2f} {cold['first_s'] - warm['first_s']:12.1f}")
    print("first step: from creating the runner (clBuildProgram included) to the first loss; kernels: distinct "
          "__kernel functions, each compiled once; compiling: cold first step - warm first step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
