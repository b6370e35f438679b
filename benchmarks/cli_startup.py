"""Wall time of the command line's cheap answers: `--help`, a command's `--help`, argument errors.

    python benchmarks/cli_startup.py [--repeats 11] [--repo PATH]

Each case runs as its own process (`python -m fblc.cli ...` in the checkout, as a user's shell
runs `fblc`), `--repeats` times in turn with the others; the table gives the median, the fastest
and the median over the 0.3 s target (issue 36: a newcomer's `fblc --help` took 1.5 s, every
error 1.5-4 s, because building the parser imported onnx). The first row is the interpreter
alone (`python -c pass`), the floor under every case. `--repo` times another checkout's fblc
(e.g. `git worktree add /tmp/before HEAD~3`) for a before/after on the same machine.
A benchmark, not a test: no threshold (tests/test_cli_rough_edges.py checks what the parser imports).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 0.3

#: name -> (arguments after `python`, the exit status that answer gives)
CASES: dict[str, tuple[list[str], int]] = {
    "python -c pass (floor)": (["-c", "pass"], 0),
    "fblc --help": (["-m", "fblc.cli", "--help"], 0),
    "fblc compile --help": (["-m", "fblc.cli", "compile", "--help"], 0),
    "fblc run --help": (["-m", "fblc.cli", "run", "--help"], 0),
    "fblc check --help": (["-m", "fblc.cli", "check", "--help"], 0),
    "fblc compile (no model)": (["-m", "fblc.cli", "compile"], 2),
    "fblc run B --lr x": (["-m", "fblc.cli", "run", "bundle", "--data", "d.npz", "--lr", "x"], 2),
    "fblc compile M --loss bogus": (["-m", "fblc.cli", "compile", "m.onnx", "-o", "out", "--loss", "bogus"], 2),
    "fblc compile M --lr nan": (["-m", "fblc.cli", "compile", "m.onnx", "-o", "out", "--lr", "nan"], 2),
}


def time_once(arguments: list[str], expected: int, repo: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *arguments], cwd=repo, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != expected:
        raise SystemExit(f"python {' '.join(arguments)} exited {done.returncode}, not {expected}:\n{done.stderr}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11, help="runs of each case (default 11)")
    parser.add_argument("--repo", default=REPO, help="the checkout whose fblc runs (default: this one)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):  # round by round: a drift of the shared machine reaches every case alike
        for name, (arguments, expected) in CASES.items():
            times[name].append(time_once(arguments, expected, args.repo))
    print(f"fblc at {os.path.abspath(args.repo)}, {sys.executable}, median of {args.repeats} processes each")
    print(f"{'case':<30} {'median s':>9} {'fastest s':>10} {'/ 0.3 s':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<30} {median:9.3f} {min(samples):10.3f} {median / TARGET_S:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
