"""Share of a step's FLOPs in launches with fewer work-items than the device runs at once (issue 39, item 3).

    python benchmarks/small_launches.py MODEL.onnx [MODEL.onnx ...] [--targets adreno830,adreno730,mali-g925]
                                        [--before DIR]

Each model is compiled for each target (here, and with --before also from the fblc checkout at DIR, e.g. an
older revision unpacked with `git archive REV | tar -x -C DIR`); a launch is small when its plan.json `items`
(work-items that do work; a group kernel's items times its group) is under the target's device_items
(Profile.device_items of this tree: compute_units x waves_per_unit x wave_size), and its FLOPs are report.json's
estimate. The table gives launches, small launches and their FLOP share, before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fblc.profiles import load_profile  # noqa: E402


def compile_in(tree: str, model: str, target: str, out: str) -> None:
    done = subprocess.run([sys.executable, "-m", "fblc.cli", "compile", model, "--target", target, "-o", out,
                           "--force", "-q"], cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compiling {model} for {target} in {tree} failed:\n{done.stderr[-3000:]}")


def small_share(bundle: str, device_items: int) -> tuple[int, int, float]:
    """(launches, launches under device_items work-items, their share of the step's FLOPs in %)."""
    with open(os.path.join(bundle, "plan.json"), encoding="utf-8") as handle:
        launches = json.load(handle)["kernels"]
    with open(os.path.join(bundle, "report.json"), encoding="utf-8") as handle:
        flops = {k["kernel"]: k["flops"] for k in json.load(handle)["estimate"]["kernels"]}
    small = [launch for launch in launches if launch["items"] < device_items]
    total = sum(flops.values()) or 1
    return len(launches), len(small), 100.0 * sum(flops.get(launch["name"], 0) for launch in small) / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="ONNX models to compile")
    parser.add_argument("--targets", default="adreno830,adreno730,mali-g925")
    parser.add_argument("--before", metavar="DIR", help="an fblc checkout to compare against (before)")
    args = parser.parse_args()
    sides = ([("before", os.path.abspath(args.before))] if args.before else []) + [("after", ROOT)]
    print(f"{'model':<24} {'target':<10} {'device':>6}  " + "  ".join(
        f"{side + ' launches':>16}  {side + ' small':>13}  {side + ' FLOP %':>14}" for side, _ in sides))
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            name = os.path.splitext(os.path.basename(model))[0]
            for target in args.targets.split(","):
                device = load_profile(target).device_items
                cells = []
                for side, tree in sides:
                    bundle = os.path.join(scratch, f"{side}-{name}-{target}")
                    compile_in(tree, os.path.abspath(model), target, bundle)
                    launches, small, share = small_share(bundle, device)
                    cells.append(f"{launches:>16}  {small:>13}  {share:>14.1f}")
                print(f"{name:<24} {target:<10} {device:>6}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
