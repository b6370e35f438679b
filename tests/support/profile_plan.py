"""A smaller measurement plan for the suite's `fblc profile` runs (local pyopencl, native runner, adb).

The shipped plan reads a 64 MiB image ~100 times, 60 latency-bound pair launches of 262,144 pairs and a 537 M-FMA
loop five times: ~20 CPU s on PoCL per profile, three profiles in the suite. The tests check the path (every probe
planned, run by the backend, interpreted, written, loaded, its figures marked measured and in a cache's range), not
the figures' accuracy, which is benchmarks/profile_ranking.py's subject at the shipped size. The small plan has the
same launches, kernels, local sizes, too-large rules and probes in the same order (so interpret and every backend
run the same code), with a 512 x 512 image (4 MiB; its 16,384 places of 16-texel blocks still hold the largest
footprint's 8,192), fewer pairs per work-item, fewer capacity reads and FMA iterations, and at most two repeats a
launch (best-of still taken): ~1 CPU s.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fblc.profiles import profiler

SMALL = {"IMAGE_SIDE": 512, "PAIRS_PER_ITEM": 32, "FOOTPRINT_READS": 8192, "FMA_ITERATIONS": 256}
REPEATS = 2


@contextmanager
def small_profile_plan() -> Iterator[None]:
    """`profiler.measurement_plan` (which `fblc profile` looks up when it runs) returns the small plan inside."""
    shipped = profiler.measurement_plan

    def small() -> profiler.Plan:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in SMALL.items():
                assert getattr(profiler, name) > value, name  # smaller than shipped, or this plan is no cut
                patch.setattr(profiler, name, value)
            plan = shipped()
        for launch in plan["launches"]:
            launch["repeats"] = min(launch["repeats"], REPEATS)
        return plan

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiler, "measurement_plan", small)
        yield
