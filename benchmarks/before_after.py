"""One benchmark run on two versions of fblc, side by side: a git revision (before) and this tree (after).

    python benchmarks/before_after.py --base bdd1ccf step_time.py --models mlp,tresnet --steps 5
    python benchmarks/before_after.py --base bdd1ccf instructions.py --models mlp

The revision is checked out into a temporary git worktree; the benchmark script (a module of
benchmarks/) runs there and here in turn, twice each (before, after, before, after), so both see
the same minutes of a shared machine, and the table gives each number of every row before and
after, the after / before ratio, and for timings the spread between a side's two runs (its noise).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = re.compile(r"^-?[\d,]+(\.\d+)?$")


def run(tree: str, script: str, args: list[str]) -> list[str]:
    """The table lines the benchmark printed on stdout, run from checkout `tree`."""
    done = subprocess.run([sys.executable, os.path.join(tree, "benchmarks", script), *args], cwd=tree,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed in {tree}:\n{done.stderr[-3000:]}")
    return done.stdout.splitlines()


def rows_of(lines: list[str]) -> dict[str, list[float]]:
    """Row label (the columns before the first number) -> its numbers, for every line that has numbers."""
    rows = {}
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        first = next((k for k, cell in enumerate(cells) if NUMBER.match(cell)), None)
        if first is None or first == 0:
            continue
        rows[" / ".join(cells[:first])] = [float(c.replace(",", "")) for c in cells[first:] if NUMBER.match(c)]
    return rows


def column_names(lines: list[str]) -> list[str]:
    """The names of the number columns: the header line whose cells match the first row's."""
    for k, line in enumerate(lines):
        cells = re.split(r"\s{2,}", line.strip())
        first = next((j for j, cell in enumerate(cells) if NUMBER.match(cell)), None)
        if first:
            for header in reversed(lines[:k]):
                names = re.split(r"\s{2,}", header.strip())
                if len(names) == len(cells):
                    return names[first:]
            break
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against (before)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("script", help="a benchmark of benchmarks/: step_time.py, instructions.py ...")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        base = os.path.join(scratch, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", base, options.base], check=True)
        try:
            runs: dict[str, list[dict[str, list[float]]]] = {"before": [], "after": []}
            names: list[str] = []
            for _ in range(options.runs):
                for side, tree in (("before", base), ("after", ROOT)):
                    lines = run(tree, options.script, options.args)
                    names = names or column_names(lines)
                    runs[side].append(rows_of(lines))
                    print(f"  ran {options.script} {side}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)
    print(f"{options.script} {' '.join(options.args)}: before = {options.base}, after = this tree; "
          f"each side run {options.runs} times, alternating (first run's value; spread = max/min over runs)")
    print(f"{'row':<36} {'column':>16} {'before':>14} {'after':>14} {'after/before':>13} {'spread b':>9} {'spread a':>9}")
    for label, values in runs["before"][0].items():
        after = runs["after"][0].get(label)
        if after is None:
            print(f"{label:<36} (missing after)")
            continue
        for column, (old, new) in enumerate(zip(values, after)):
            spreads = []
            for side in ("before", "after"):
                seen = [r[label][column] for r in runs[side] if label in r and len(r[label]) > column]
                spreads.append(max(seen) / min(seen) if seen and min(seen) > 0 else float("nan"))
            ratio = new / old if old else float("nan")
            name = names[column] if column < len(names) else str(column)
            print(f"{label[:36]:<36} {name[:16]:>16} {old:14,.3f} {new:14,.3f} {ratio:13.3f} {spreads[0]:9.3f} "
                  f"{spreads[1]:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
