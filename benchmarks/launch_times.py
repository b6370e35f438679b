"""Each launch of a training step timed on the local OpenCL device, ranked by time against the FLOPs it does.

    python benchmarks/launch_times.py BUNDLE [--storage buffer] [--repeats 5] [--top 25] [--feeds FEEDS.npz]
    python benchmarks/launch_times.py BUNDLE --against OTHER [--storage image] [--repeats 10]

Runs BUNDLE's step `repeats` times on a profiling queue (LocalRunner), keeps each launch's least device time
(the one least disturbed by a shared machine's other work), and prints the launches that take most of the step:
ms, share of the step, GFLOP/s (the kernel's FLOPs from report.json's estimate; a contraction's FLOPs are
counted at its first kernel), family, schedule and items. Then the same per family. Feeds are random
(shapes and types from the manifest; integer inputs within 0..2) unless FEEDS.npz is given.
With --against OTHER (a bundle of the same model compiled by another tree or with other choices: the same
launches), each launch runs in turn with its twin in OTHER, launch by launch, and the least time of each over the
repeats is kept: a shared machine's slow spells fall on both alike. It prints both steps' totals, their ratio
and the launches that changed most.
Which kernels make a step slow, not whether it is correct: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.runtime.local import LocalRunner  # noqa: E402


def random_feeds(manifest: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for entry in manifest["inputs"]:
        shape = entry["shape"]
        feeds[entry["name"]] = (rng.integers(0, 3, shape).astype(entry["dtype"]) if "int" in entry["dtype"]
                                else rng.standard_normal(shape).astype(np.float32))
    return feeds


def launch_ms(runner: LocalRunner, feeds: dict[str, np.ndarray], repeats: int) -> list[float]:
    """Each launch's least device time in ms over `repeats` steps (after one warm-up step); a loop's launch (ES
    members) all its repetitions in a step."""
    runner.step(feeds)
    best = [float("inf")] * len(runner.kernels)
    for _ in range(repeats):
        runner.check_feeds(feeds)
        for entry in runner.manifest["inputs"]:
            runner.upload(entry["texture"], np.asarray(feeds[entry["name"]]))
        launched = [(index, runner.launch(index)) for index in runner.launch_sequence()]
        runner.queue.finish()
        step = [0.0] * len(runner.kernels)
        for index, event in launched:
            step[index] += (event.profile.end - event.profile.start) * 1e-6
        best = [min(b, s) for b, s in zip(best, step)]
    return best


def paired_launch_ms(runners: list[LocalRunner], feeds: dict[str, np.ndarray], repeats: int) -> np.ndarray:
    """[bundle, launch]: each launch's least device time in ms over `repeats` rounds, the bundles' twins run in
    turn (after one whole step of each, so every texture holds a step's values)."""
    for runner in runners:
        runner.step(feeds)
    best = np.full((len(runners), len(runners[0].kernels)), np.inf)
    for _ in range(repeats):
        for index in range(best.shape[1]):
            for side, runner in enumerate(runners):
                event = runner.launch(index)
                event.wait()
                best[side, index] = min(best[side, index], (event.profile.end - event.profile.start) * 1e-6)
    return best


def compare(args: argparse.Namespace) -> int:
    runners = [LocalRunner(bundle, profiling=True, storage=args.storage, progress=False)
               for bundle in (args.bundle, args.against)]
    names = [[k["name"] for k in runner.plan["kernels"]] for runner in runners]
    if names[0] != names[1]:
        raise SystemExit(f"--against: {args.against} launches other kernels than {args.bundle} "
                         f"({len(names[1])} against {len(names[0])}); compile the same model with the same options")
    feeds = dict(np.load(args.feeds)) if args.feeds else random_feeds(runners[0].manifest)
    best = paired_launch_ms(runners, feeds, args.repeats)
    totals = best.sum(axis=1)
    print(f"{args.bundle}: {totals[0]:.2f} ms, {args.against}: {totals[1]:.2f} ms of device time per step "
          f"({args.storage}, {len(names[0])} launches, least of {args.repeats} rounds each); ratio "
          f"{totals[1] / totals[0]:.3f}")
    print(f"{'ms':>8} {'against':>8} {'change':>8}  kernel")
    for index in sorted(range(best.shape[1]), key=lambda k: -abs(best[1, k] - best[0, k]))[:args.top]:
        print(f"{best[0, index]:8.3f} {best[1, index]:8.3f} {best[1, index] - best[0, index]:+8.3f}  {names[0][index]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--storage", default="buffer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--feeds", help="an .npz of the manifest's inputs (default: random)")
    parser.add_argument("--against", metavar="OTHER", help="a bundle of the same launches to time against, launch "
                        "by launch in turns")
    args = parser.parse_args(argv)
    if args.against:
        return compare(args)
    runner = LocalRunner(args.bundle, profiling=True, storage=args.storage, progress=False)
    feeds = dict(np.load(args.feeds)) if args.feeds else random_feeds(runner.manifest)
    times = launch_ms(runner, feeds, args.repeats)
    with open(os.path.join(args.bundle, "report.json")) as report:
        flops = {k["kernel"]: k["flops"] for k in json.load(report)["estimate"]["kernels"]}
    total = sum(times)
    launches = runner.plan["kernels"]
    print(f"{args.bundle}: {len(launches)} launches, {total:.2f} ms of device time per step ({args.storage}), "
          f"{sum(flops.values()) / 1e9:.3f} GFLOP")
    print(f"{'ms':>8} {'share':>6} {'GFLOP/s':>8}  {'kernel':<34} {'family':<14} {'items':>8}  schedule")
    for index in sorted(range(len(launches)), key=lambda k: -times[k])[:args.top]:
        spec = launches[index]
        rate = flops.get(spec["name"], 0) / (times[index] * 1e6) if times[index] else 0.0
        schedule = json.dumps(spec.get("schedule", {}), separators=(",", ":"))[:70]
        print(f"{times[index]:8.3f} {times[index] / total:6.1%} {rate:8.2f}  {spec['name'][:34]:<34} "
              f"{spec.get('family', '?')[:14]:<14} {spec.get('items', 0):8d}  {schedule}")
    per_family: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for index, spec in enumerate(launches):
        row = per_family[spec.get("family", "?")]
        row[0] += times[index]
        row[1] += flops.get(spec["name"], 0)
        row[2] += 1
    print(f"\n{'family':<16} {'launches':>8} {'ms':>8} {'share':>6} {'GFLOP/s':>8}")
    for family, (ms, fl, count) in sorted(per_family.items(), key=lambda item: -item[1][0]):
        print(f"{family:<16} {count:8d} {ms:8.3f} {ms / total:6.1%} {fl / (ms * 1e6) if ms else 0:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
