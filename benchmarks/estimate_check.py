"""report.json's estimate against a measurement: per-kernel times on the local OpenCL device.

    python benchmarks/estimate_check.py [--models llama,mobilenet_v2] [--steps 3]

The local device is profiled first (`fblc profile --device local`: its measured peak and
bandwidth), each model is compiled for that profile, and its step runs on the device with
OpenCL profiling events. The table compares the estimate's step time with the measured one, and
the estimate's ranking of kernels with the measured ranking (Spearman's rank correlation over all
kernels, and how many of the measured 10 slowest the estimate also puts in its 10 slowest).
Models as in benchmarks/layout.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.layout import CASES  # noqa: E402
from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402

TOP = 10


def ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranked = np.empty(len(values))
    ranked[order] = np.arange(len(values))
    return ranked


def measured_kernel_ms(bundle: str, feeds: dict, steps: int) -> np.ndarray:
    runner = LocalRunner(bundle, profiling=True, progress=False, storage="image")
    runner.step(feeds)  # the OpenCL JIT
    samples = []
    for _ in range(steps):
        launched = [(index, runner.launch(index)) for index in runner.launch_sequence()]
        runner.queue.finish()
        step = [0.0] * len(runner.kernels)  # a loop's launch (ES members): all its repetitions, as the estimate
        for index, event in launched:
            step[index] += (event.profile.end - event.profile.start) * 1e-6
        samples.append(step)
    return np.median(np.asarray(samples), axis=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        profile = os.path.join(directory, "measured-local.json")
        subprocess.run([sys.executable, "-m", "fblc.cli", "profile", "--device", "local", "-o", profile, "-q"],
                       check=True)
        for key in args.models.split(","):
            name, path, feeds = CASES[key](directory)
            bundle = os.path.join(directory, key)
            _, report = compile_model(path, bundle, profile, "fp32", TrainingOptions(
                loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2)))
            estimated = np.array([k["ms"] for k in report["estimate"]["kernels"]])
            measured = measured_kernel_ms(bundle, feeds, args.steps)
            rho = float(np.corrcoef(ranks(estimated), ranks(measured))[0, 1])
            top_both = len(set(np.argsort(-estimated)[:TOP]) & set(np.argsort(-measured)[:TOP]))
            rows.append((name, report["estimate"]["step_ms"], float(measured.sum()), rho, top_both, len(measured)))
            print(f"  {name}: estimated {report['estimate']['step_ms']:.1f} ms, measured {measured.sum():.1f} ms",
                  file=sys.stderr)
    print(f"{'model':<26} {'kernels':>8} {'estimate ms':>12} {'measured ms':>12} {'ratio':>7} {'rank rho':>9} "
          f"{'top-' + str(TOP) + ' shared':>14}")
    for name, estimate, measured, rho, top_both, count in rows:
        print(f"{name:<26} {count:8d} {estimate:12.1f} {measured:12.1f} {measured / estimate:7.2f} {rho:9.2f} "
              f"{top_both:>11d}/{TOP}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
