"""Per-step host overhead: the native runner (C) against the Python runtime (pyopencl), same bundle, same device.

    python benchmarks/runner_overhead.py [--steps 30] [--models elementwise,mlp,tresnet] [--runner PATH]

Both train the same bundle on the local OpenCL device (PoCL from the pyopencl wheel: the runner reaches
it through libOpenCL.so.1 and an ICD file, see fblc.runtime.native.pocl_wheel_environment) with
profiling events on. Two figures per step, medians over `--steps` steps after one warm-up step:
- submit: host time from the start of the step until the last kernel is enqueued (data uploads,
  kernel arguments, enqueue calls), measured on the host; also per kernel launch;
- overhead: wall time of the step minus the device time of its kernels (the sum of their profiling
  intervals): everything that is not kernel execution, the loss read-back and queue gaps included.
  On a CPU device the kernels share the cores with the host, so this one is noisy for big steps.
The runner is built with CMake unless --runner is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402
from fblc.runtime.native import build_runner, pocl_wheel_environment, pyopencl_build_options, run_runner  # noqa: E402

ADAMW = OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2)
Feeds = dict[str, np.ndarray]


def build_cases(directory: str, names: list[str]) -> list[tuple[str, str, Feeds]]:
    """(label, bundle folder, one batch) per model."""
    rng = np.random.default_rng(0)
    cases = []
    if "elementwise" in names:
        from tests.test_runtime import OPTIONS, batch, elementwise_model

        bundle = os.path.join(directory, "elementwise")
        compile_model(elementwise_model(os.path.join(directory, "elementwise.onnx")), bundle, "local", "fp32", OPTIONS)
        cases.append(("sigmoid(x*w+b) 3x5", bundle, batch()))
    if "mlp" in names:
        from mlp import build_mlp

        path = build_mlp(os.path.join(directory, "mlp.onnx"), batch=8)
        bundle = os.path.join(directory, "mlp")
        compile_model(path, bundle, "local", "fp32", TrainingOptions(loss="cross_entropy", optimizer=ADAMW))
        cases.append(("mlp 32-64-64-10 B=8", bundle, {"x": rng.standard_normal((8, 32)).astype(np.float32),
                                                       "labels": rng.integers(0, 10, 8).astype(np.int64)}))
    if "tresnet" in names:
        from tresnet import build_tresnet

        path = build_tresnet(os.path.join(directory, "tresnet.onnx"), batch=4, channels=6, samples=16, classes=5)
        bundle = os.path.join(directory, "tresnet")
        compile_model(path, bundle, "local", "fp32", TrainingOptions(loss="cross_entropy", optimizer=ADAMW))
        cases.append(("t-resnet B=4 [6x16]", bundle, {"x": rng.standard_normal((4, 6, 16, 1)).astype(np.float32),
                                                       "labels": rng.integers(0, 5, 4).astype(np.int64)}))
    return cases


def python_overheads(bundle: str, feeds: Feeds, steps: int) -> tuple[list[float], list[float], list[float], int]:
    """(wall, kernel, submit) ms per step of LocalRunner with profiling, after a warm-up step; kernel launches."""
    runner = LocalRunner(bundle, profiling=True, storage="image")  # as the native runner
    launched: list[list[Any]] = []
    submitted: list[float] = []
    run_kernels: Callable[[], list[Any]] = runner.run_kernels

    def timed_run_kernels() -> list[Any]:
        launched.append(run_kernels())
        submitted.append(time.perf_counter())
        return launched[-1]

    runner.run_kernels = timed_run_kernels  # type: ignore[method-assign]
    walls, kernels, submits = [], [], []
    for step in range(steps + 1):
        started = time.perf_counter()
        runner.step(feeds)
        wall = (time.perf_counter() - started) * 1e3
        device = sum(e.profile.end - e.profile.start for e in launched[-1]) * 1e-6
        if step:
            walls.append(wall)
            kernels.append(device)
            submits.append((submitted[-1] - started) * 1e3)
    return walls, kernels, submits, len(runner.plan["kernels"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", default="elementwise,mlp,tresnet")
    parser.add_argument("--runner", help="a built fblc-runner (default: build one with CMake into a temporary folder)")
    args = parser.parse_args()
    env = {**pocl_wheel_environment(), **pyopencl_build_options()}
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        runner = args.runner or build_runner(os.path.join(directory, "runner-build"))
        for label, bundle, feeds in build_cases(directory, args.models.split(",")):
            walls, kernels, submits, launches = python_overheads(bundle, feeds, args.steps)
            results = run_runner(runner, bundle, [feeds], args.steps + 1, env=env, kernel_times=True)
            native = list(zip(results.step_ms[1:], results.kernel_ms[1:]))
            rows.append((label, launches,
                         statistics.median(submits), statistics.median(w - k for w, k in zip(walls, kernels)),
                         statistics.median(results.submit_ms[1:]), statistics.median(w - k for w, k in native)))
            print(f"  measured {label} on {results.device['name']}", file=sys.stderr)
    print(f"{'bundle':<22} {'launches':>8} | {'python submit':>13} {'us/launch':>9} {'overhead':>9} | "
          f"{'native submit':>13} {'us/launch':>9} {'overhead':>9} | {'submit ratio':>12}")
    for label, launches, p_submit, p_over, n_submit, n_over in rows:
        print(f"{label:<22} {launches:8d} | {p_submit:11.3f}ms {p_submit / launches * 1e3:9.1f} {p_over:7.3f}ms | "
              f"{n_submit:11.3f}ms {n_submit / launches * 1e3:9.1f} {n_over:7.3f}ms | "
              f"{p_submit / n_submit if n_submit > 0 else float('inf'):12.1f}")
    print("submit: host time to upload the batch and enqueue every kernel of a step; overhead: step wall time minus "
          "the kernels' device time (medians per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
