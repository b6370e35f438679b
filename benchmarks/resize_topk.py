"""Resize's gradient and a long TopK on the local device: whole-step kernel time by case.

    python benchmarks/resize_topk.py [--steps 3] [--cases resize-matmul,resize-scatter,topk,topk-sort]

Each case is a tiny model trained for its op, loss sum(op(x) * R), SGD, compiled for adreno830 and run on the
local device (PoCL here); the table gives the step's kernel time (OpenCL profiling events, sum of per-kernel
medians of `--steps` after one warm-up) and the kernel count:
- resize-matmul: bilinear [1, 4, 200, 200] -> [1, 4, 300, 300] (x trained); the adjoint forms of this tree
  (b29a6f4 took A^T @ dy, a MatMul of O(in * out) per column; now a gather of R outputs per input);
- resize-scatter: linear [1, 2, 1500, 8] -> [1, 2, 2100, 8] (b29a6f4: two segment sums, sorted scatters);
- topk: TopK k=256 of [8, 1024] (largest, x trained), the selection kernel against pass sort_topk, side by
  side in one run (sort_topk's threshold raised for the first);
- topk-sort: TopK of all 65,536 of [1, 65536] (a full sort, largest, x trained): pass sort_topk's 16 MergeRuns
  launches as eb77db5 emitted them (a binary search per output: O(n log^2 n) reads) and as this tree does
  (a search per work-item of consecutive outputs: O(n log n)), side by side in one run: eb77db5's `fblc`
  (`git archive`) runs in a child process. The table adds the MergeRuns kernels' time and their reads
  (passes/sort_topk.sort_reads, resumed or not).
Run it under b29a6f4's tree (PYTHONPATH) for the Resize cases' before.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from benchmarks.estimate_check import measured_kernel_ms  # noqa: E402


def _model(path: str, x_shape: list[int], y_shape: list[int], nodes: list, extra: list) -> None:
    rng = np.random.default_rng(0)
    tail = [helper.make_node("Mul", ["y", "R"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes + tail, "case", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(rng.standard_normal(x_shape).astype(np.float32), "x"),
                               numpy_helper.from_array(rng.standard_normal(y_shape).astype(np.float32), "R")] + extra)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)


def _resize(x_shape: list[int], y_shape: list[int]) -> Callable[[str], None]:
    def write(path: str) -> None:
        sizes = numpy_helper.from_array(np.array(y_shape, np.int64), "sizes")
        node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear")
        _model(path, x_shape, y_shape, [node], [sizes])
    return write


def _topk(path: str) -> None:
    k = numpy_helper.from_array(np.array([256], np.int64), "k")
    _model(path, [8, 1024], [8, 256], [helper.make_node("TopK", ["x", "k"], ["y", "i"], axis=-1)], [k])


SORTED_LINE = 65536


def _topk_sort(path: str) -> None:
    k = numpy_helper.from_array(np.array([SORTED_LINE], np.int64), "k")
    _model(path, [1, SORTED_LINE], [1, SORTED_LINE], [helper.make_node("TopK", ["x", "k"], ["y", "i"], axis=-1)], [k])


CASES: dict[str, Callable[[str], None]] = {
    "resize-matmul": _resize([1, 4, 200, 200], [1, 4, 300, 300]),
    "resize-scatter": _resize([1, 2, 1500, 8], [1, 2, 2100, 8]),
    "topk": _topk,
    "topk-sort": _topk_sort,
}
#: the tree whose MergeRuns searched once per output (the topk-sort case's before)
SEARCH_PER_OUTPUT = "eb77db5"


def timed(path: str, bundle: str, steps: int) -> tuple[float, int, float]:
    """(step kernel ms, kernels, the MergeRuns kernels' ms) of `path` compiled into `bundle` and run."""
    compile_model(path, bundle, "adreno830", "fp32", TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd",
                                                                                                             lr=0.1)))
    with open(os.path.join(bundle, "plan.json"), encoding="utf-8") as handle:
        names = [k["name"] for k in json.load(handle)["kernels"]]
    ms = measured_kernel_ms(bundle, {}, steps)
    return float(ms.sum()), len(names), float(sum(t for n, t in zip(names, ms) if n.endswith("_MergeRuns")))


def timed_in_tree(tree: str, path: str, bundle: str, steps: int) -> tuple[float, int, float]:
    """timed() with `fblc` imported from `tree` (a directory holding an fblc package), in a child process."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {tree!r}); import fblc; sys.path.insert(1, {repo!r}); "  # fblc from tree
            f"from benchmarks.resize_topk import timed; print(*timed({path!r}, {bundle!r}, {steps}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    return float(out[-3]), int(out[-2]), float(out[-1])


def _sort_forms(directory: str, path: str, steps: int) -> None:
    from fblc.passes.sort_topk import sort_reads
    old = os.path.join(directory, SEARCH_PER_OUTPUT)
    os.makedirs(old)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", repo, "archive", SEARCH_PER_OUTPUT, "fblc"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
    for label, resumed in ((SEARCH_PER_OUTPUT, False), ("this tree", True)):
        bundle = os.path.join(directory, f"topk-sort-{resumed}")
        ms, count, merges = timed_in_tree(old, path, bundle, steps) if not resumed else timed(path, bundle, steps)
        reads = sort_reads(SORTED_LINE, SORTED_LINE, resumed)
        print(f"{'topk-sort':<16} {label:<10} {ms:9.1f} {count:8d} {merges:11.1f} {reads:13,d}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(f"{'case':<16} {'form':<10} {'step ms':>9} {'kernels':>8} {'MergeRuns ms':>11} {'MergeRuns reads':>13}")
    with tempfile.TemporaryDirectory() as directory:
        for case in args.cases.split(","):
            path = os.path.join(directory, f"{case}.onnx")
            CASES[case](path)
            if case == "topk-sort":
                _sort_forms(directory, path, args.steps)
                continue
            forms = [("this tree", None)]
            if case == "topk":
                from fblc.passes import sort_topk
                forms = [("selection", 10 ** 9), ("sorted", sort_topk.SORTED_TOPK_LINE)]
            for label, line in forms:
                if line is not None:
                    sort_topk.SORTED_TOPK_LINE = line
                ms, count, merges = timed(path, os.path.join(directory, f"{case}-{label}"), args.steps)
                print(f"{case:<16} {label:<10} {ms:9.1f} {count:8d} {merges:11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
