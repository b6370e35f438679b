"""Does the texture-cache model rank the profiler's read patterns as the device measures them?

    python benchmarks/profile_ranking.py [--device local] [--repeats 3]

Measures the local OpenCL device with `fblc profile` (`--repeats` times, each a fresh profile),
then runs the cache model with each profile's measured geometry over the profiler's own read
orders and prints, per pattern, the simulated misses beside the measured throughput (geometric
mean over work-group sizes, relative to column-major), and whether the two agree at both ends:
the pattern measured fastest is one the model gives the fewest misses, and the fewest-miss
patterns read faster, on geometric average, than the pattern the model gives the most. Timing
on a CPU device (PoCL) moves with machine load, so this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.cli import main as fblc  # noqa: E402
from fblc.profiles import load_profile  # noqa: E402
from fblc.profiles.cache_model import PATTERNS, CacheGeometry, pattern_reads, simulate  # noqa: E402
from fblc.profiles.profiler import IMAGE_SIDE, READS_PER_THREAD  # noqa: E402


def agreement(path: str) -> tuple[CacheGeometry, dict[str, int], dict[str, float], bool]:
    """(geometry, model misses per pattern, measured speed per pattern, whether they agree at both ends)."""
    profile = load_profile(path)
    relative = profile.raw["measurements"]["relative_to_column_major"]
    speed = {p: float(np.exp(np.mean(np.log(list(row.values()))))) for p, row in relative.items()}
    geometry = CacheGeometry.of(profile)
    total = IMAGE_SIDE * IMAGE_SIDE // READS_PER_THREAD
    misses = {p: sum(simulate(geometry, pattern_reads(p, int(t), READS_PER_THREAD, IMAGE_SIDE, IMAGE_SIDE, total),
                              total // int(t), sample=8).misses for t in relative[p]) for p in PATTERNS}
    fastest, worst = max(speed, key=speed.__getitem__), max(misses, key=misses.__getitem__)
    fewest = [p for p in PATTERNS if misses[p] == min(misses.values())]
    agrees = (min(misses.values()) < max(misses.values()) and misses[fastest] == min(misses.values())
              and float(np.mean([np.log(speed[p]) for p in fewest])) > np.log(speed[worst]))
    return geometry, misses, speed, agrees


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="local", help="device to profile (default: local)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh profiles to measure (default: 3)")
    args = parser.parse_args()
    agreed = 0
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(args.repeats):
            path = os.path.join(scratch, f"profile{run}.json")
            started = time.perf_counter()
            if fblc(["profile", "--device", args.device, "-o", path]) != 0:
                return 1
            seconds = time.perf_counter() - started
            geometry, misses, speed, agrees = agreement(path)
            agreed += agrees
            print(f"run {run + 1}: profiled in {seconds:.1f} s; measured blocks {geometry.block_width}x"
                  f"{geometry.block_height}, {geometry.sets} sets x {geometry.ways} ways")
            print(f"  {'pattern':<14} {'model misses':>14} {'measured speed':>16}")
            for pattern in PATTERNS:
                print(f"  {pattern:<14} {misses[pattern]:>14} {speed[pattern]:>16.2f}")
            print(f"  model and measurement agree at both ends: {'yes' if agrees else 'no'}")
    print(f"agreement in {agreed} of {args.repeats} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
