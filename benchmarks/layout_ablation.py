"""What each part of the layout search buys: simulated misses, block fetches and PoCL step time per variant.

    python benchmarks/layout_ablation.py [--models llama,mobilenet_v2] [--targets adreno830,adreno730,mali-g925]
                                         [--variants naive,flat,blocks,traced] [--steps 3]

Every variant compiles the same model with the same kernels, register tiles and remapping; only the
layout choice differs (naive, the conventional baseline, also drops tiles and remapping):
- flat: every tensor flat (`--layout-search flat`);
- blocks: the block count of synthetic wave walks decides (the default);
- traced: the step's kernels are traced once (under flat), and their real reads through the cache
  model decide (`--layout-search traced`);
For each: the simulated texture-cache misses and block fetches of the whole step for the target
(fblc.tools.cache_report: each bundle's own kernels traced, 2 work-groups per launch), and the median
PoCL step time on this CPU (same device for every target: only the layouts differ). Models as in
benchmarks/layout.py: the Llama decoder at batch 4, sequence 128, and MobileNetV2 at [16, 3, 97, 60].
Issue targets: naive/traced misses >= 4.2x and block fetches >= 3.5x on adreno830; traced beats
blocks and flat on misses somewhere and never loses by more than 2 %.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.layout import CASES  # noqa: E402
from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from fblc.profiles import load_profile  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402
from fblc.runtime.trace import ReadTracer  # noqa: E402
from fblc.tools.cache_report import cache_report  # noqa: E402
from fblc.tools.traced_layouts import with_traced_reads  # noqa: E402

BASE = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2))
VARIANTS = {
    "naive": dataclasses.replace(BASE, layout="naive"),
    "flat": dataclasses.replace(BASE, layout_search="flat"),
    "blocks": BASE,
    "traced": dataclasses.replace(BASE, layout_search="traced"),
}
PAPER = {"misses": 4.2, "block_fetches": 3.5}


def measure(path: str, feeds: dict, bundle: str, target: str, options: TrainingOptions, steps: int) -> dict[str, float]:
    options = with_traced_reads(path, target, "fp32", options, feeds)
    compile_model(path, bundle, target, "fp32", options)
    tracer = ReadTracer(bundle)
    cache = cache_report(bundle, load_profile(target), feeds, tracer=tracer)
    runner = LocalRunner(bundle, progress=False, storage="image")
    runner.step(feeds)  # the OpenCL JIT
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        runner.step(feeds)
        times.append((time.perf_counter() - started) * 1e3)
    return {"misses": cache["misses"], "block_fetches": cache["block_fetches"], "ms": statistics.median(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--targets", default="adreno830,adreno730,mali-g925")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for key in args.models.split(","):
            name, path, feeds = CASES[key](directory)
            for target in args.targets.split(","):
                for variant in variants:
                    started = time.perf_counter()
                    figures = measure(path, feeds, os.path.join(directory, f"{key}.{target}.{variant}"), target,
                                      VARIANTS[variant], args.steps)
                    print(f"  {name} {target} {variant}: {figures['misses']} misses, {figures['ms']:.0f} ms per step "
                          f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
                    rows.append((name, target, variant, figures))
    print(f"{'model':<26} {'target':<10} {'variant':<15} {'misses':>11} {'fetches':>10} {'step ms':>8} "
          f"{'misses vs traced':>17}")
    for name, target, variant, figures in rows:
        traced = next((f for n, t, v, f in rows if (n, t, v) == (name, target, "traced")), None)
        ratio = f"{figures['misses'] / max(traced['misses'], 1):.2f}x" if traced else ""
        print(f"{name:<26} {target:<10} {variant:<15} {figures['misses']:11d} {figures['block_fetches']:10d} "
              f"{figures['ms']:8.0f} {ratio:>17}")
    for name, target in sorted({(n, t) for n, t, _, _ in rows}):
        found = {v: f for n, t, v, f in rows if (n, t) == (name, target)}
        if "naive" in found and "traced" in found:
            print(f"{name} {target}: naive/traced " + ", ".join(
                f"{figure} {found['naive'][figure] / max(found['traced'][figure], 1):.2f}x (FBLayout {paper:g}x)"
                for figure, paper in PAPER.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
