"""An embedding's gradient on the local device: the row scatter scanning every token id per row, against
the sorted one (pass sort_scatter_rows), side by side in one run.

    python benchmarks/embedding_gradient.py [--steps 3] [--shapes 32000x256x2048,128256x64x512]

Each shape VxDxN is a [V, D] table read at N token ids (random, so rows repeat), loss sum(E * R),
SGD, compiled for adreno830 and run on the local device (PoCL here). The table gives the scatter
kernel's own time (OpenCL profiling events; for the sorted form its MergeRuns passes too) and the
whole step's, sums of per-kernel medians of `--steps` after one warm-up, and unsorted over sorted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes import sort_scatter_rows  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from benchmarks.estimate_check import measured_kernel_ms  # noqa: E402

SCATTER_KERNELS = ("ScatterElements", "ScatterSortedRows", "MergeRuns")


def embedding_model(path: str, rows: int, width: int, count: int) -> None:
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0), helper.make_node("Mul", ["e", "R"], ["m"]),
         helper.make_node("ReduceSum", ["m"], ["y"], keepdims=0)], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [count])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(rng.standard_normal((rows, width)).astype(np.float32), "table"),
         numpy_helper.from_array(rng.standard_normal((count, width)).astype(np.float32), "R")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)


def timed(path: str, bundle: str, ids: np.ndarray, steps: int) -> tuple[float, float]:
    """(scatter kernels ms, step ms): sums of per-kernel medians over `steps` after a warm-up step."""
    compile_model(path, bundle, "adreno830", "fp32",
                  TrainingOptions(loss="output", optimizer=OptimizerConfig("sgd", lr=0.1)))
    kernel_ms = measured_kernel_ms(bundle, {"ids": ids}, steps)
    with open(os.path.join(bundle, "plan.json"), encoding="utf-8") as handle:
        names = [k["name"].split("_", 1)[1] for k in json.load(handle)["kernels"]]
    return float(sum(ms for name, ms in zip(names, kernel_ms) if name in SCATTER_KERNELS)), float(kernel_ms.sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shapes", default="32000x256x2048,128256x64x512")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for shape in args.shapes.split(","):
            vocab, width, count = (int(d) for d in shape.split("x"))
            path = os.path.join(directory, f"{shape}.onnx")
            embedding_model(path, vocab, width, count)
            ids = np.random.default_rng(1).integers(0, vocab, count).astype(np.int64)
            limit = sort_scatter_rows.SORTED_SCATTER_UPDATES
            sort_scatter_rows.SORTED_SCATTER_UPDATES = count  # no line is long enough: the scanning kernel
            try:
                scanning = timed(path, os.path.join(directory, f"{shape}.scan"), ids, args.steps)
            finally:
                sort_scatter_rows.SORTED_SCATTER_UPDATES = limit
            sorted_ = timed(path, os.path.join(directory, f"{shape}.sorted"), ids, args.steps)
            rows.append((shape, scanning, sorted_))
            print(f"  measured {shape}", file=sys.stderr)
    print(f"{'V x D x N':<18} {'scan ms':>9} {'sorted ms':>10} {'scatter ratio':>14} {'step scan':>10} "
          f"{'step sorted':>12} {'step ratio':>11}")
    for shape, (scan, scan_step), (fast, fast_step) in rows:
        print(f"{shape:<18} {scan:9.1f} {fast:10.1f} {scan / fast:14.1f} {scan_step:10.1f} {fast_step:12.1f} "
              f"{scan_step / fast_step:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
