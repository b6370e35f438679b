"""Would an explicit layout conversion ever pay? One layout for all of a tensor's readers against two
layouts joined by a copy kernel, on the target's estimate of the traced reads.

    python benchmarks/layout_conversions.py [--models llama,mobilenet_v2] [--targets adreno830,mali-g925]

`--layout-search traced` gives every tensor the one layout of least estimated time over all the
launches that read it, forward and backward (fblc.passes.layout_score.traced_estimate). The
alternative is a conversion: the tensor stored in layout A for some readers, copied into layout B
for the others. For every tensor read by two launches or more, this script takes the traced
streams, the same candidates (the best folds and R-Tile tiles), and compares
- joint: min over candidates of the sum of each reading launch's estimate;
- split: min over ordered pairs (A, B) of the sum of each launch's better estimate, plus the copy
  (the whole tensor read once and written once over bandwidth, and a launch overhead).
It prints how many tensors a conversion would serve better and the estimated time it would save,
against the step's estimate. Models as in benchmarks/layout.py: the Llama decoder at batch 4,
sequence 128, and MobileNetV2 at [1, 3, 97, 60] (batch 1: the trace runs one step on this CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.layout import llama_case, mobilenet_case  # noqa: E402
from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.compiler.values import static_shape  # noqa: E402
from fblc.passes.layout_score import (  # noqa: E402
    TRACED_CANDIDATES,
    Geometry,
    TracedStream,
    rank_candidates,
    rank_folds,
    traced_estimate,
)
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from fblc.profiles import load_profile  # noqa: E402
from fblc.tools.traced_layouts import trace_reads  # noqa: E402

OPTIONS = TrainingOptions(loss="cross_entropy", layout_search="traced",
                          optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2))
CASES = {"llama": llama_case, "mobilenet_v2": lambda directory: mobilenet_case(directory, batch=1)}


def candidates(shape: tuple[int, ...], geometry: Geometry) -> list:
    """The layouts the traced search weighs for a tensor of `shape`: its best folds, and tiles for a matrix."""
    found = list(rank_folds(shape, (("stream", 1.0),), geometry))[:3]
    if len(shape) >= 2 and shape[-1] % 4 == 0:
        rows = int(np.prod(shape[:-1]))
        found += list(rank_candidates(rows, shape[-1], (("stream", 1.0),), geometry))[:TRACED_CANDIDATES]
    return found


def compare(streams: list[TracedStream], shape: tuple[int, ...], target: str) -> tuple[float, float]:
    """(joint ms, split ms) of one tensor's reading launches on `target`."""
    profile = load_profile(target)
    geometry = Geometry.of(profile)
    launches = sorted({s.kernel for s in streams})
    layouts = candidates(shape, geometry)
    cost = [[traced_estimate(c.layout, [s for s in streams if s.kernel == k], geometry)[0] for k in launches]
            for c in layouts]
    joint = min(sum(row) for row in cost)
    copy_ms = 2 * int(np.prod(shape)) * 4 / (profile.bandwidth_gbps * 1e6) + profile.launch_us * 1e-3
    split = min((sum(min(a, b) for a, b in zip(cost[i], cost[j])) + copy_ms
                 for i, j in itertools.permutations(range(len(layouts)), 2)), default=joint)
    return joint, split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--targets", default="adreno830,mali-g925")
    args = parser.parse_args()
    print(f"{'model':<26} {'target':<10} {'tensors':>8} {'converting pays':>16} {'saving ms':>10} {'step ms':>8}")
    with tempfile.TemporaryDirectory() as directory:
        for key in args.models.split(","):
            name, path, feeds = CASES[key](directory)
            step, _ = compile_model(path, os.path.join(directory, f"{key}.flat"), "adreno830", "fp32",
                                    dataclasses.replace(OPTIONS, layout_search="flat"))
            shapes = {v.name: tuple(static_shape(v)) for v in list(step.graph.inputs)
                      + [v for n in step.graph for v in n.outputs if v is not None and v.shape is not None]}
            for target in args.targets.split(","):
                traced = trace_reads(path, target, "fp32", OPTIONS, feeds)
                _, report = compile_model(path, os.path.join(directory, f"{key}.{target}"), target, "fp32",
                                          dataclasses.replace(OPTIONS, traced_reads=traced))
                shared = {n: list(s) for n, s in traced.items() if n in shapes and len({x.kernel for x in s}) > 1}
                results = [compare(s, shapes[n], target) for n, s in shared.items()]
                paying = [joint - split for joint, split in results if split < joint]
                print(f"{name:<26} {target:<10} {len(shared):>8} {len(paying):>16} {sum(paying):>10.4f} "
                      f"{report['estimate']['step_ms']:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
