"""One training step of each named case on whatever OpenCL device this process sees, against onnxruntime.

    oclgrind --data-races --build-options -cl-opt-disable python -m tests.support.oclgrind_steps DIR CASE..

tests/test_oclgrind.py runs it under oclgrind, whose simulated device checks every memory access
and race, and reads its last line: JSON {case: [names of the tensors that differ from onnxruntime]}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

import numpy as np

from fblc.compiler.gradients import segment_sum
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from fblc.tools.verify import verify_model
from tests.support import models

Case = Callable[[str], tuple[str, dict[str, np.ndarray], TrainingOptions]]


def _exported(build: Callable[[str], models.ExportedModel]) -> Case:
    def case(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
        exported = build(directory)
        return (exported.path, {**exported.inputs, "labels": exported.labels},
                TrainingOptions(input_shapes=exported.input_shapes, optimizer=OptimizerConfig("adamw", lr=1e-3)))
    return case


def _embedding(directory: str) -> tuple[str, dict[str, np.ndarray], TrainingOptions]:
    """Repeated and negative token ids: the sorted row scatter (MergeRuns, ScatterSortedRows)."""
    from tests.test_sort_scatter_rows import OPTIONS, embedding

    segment_sum.ONE_HOT_ELEMENTS = 0
    path = os.path.join(directory, "embedding.onnx")
    embedding(path, 37, 8, (2, 70))
    return path, {"ids": np.random.default_rng(3).integers(-37, 37, (2, 70)).astype(np.int64)}, OPTIONS


CASES: dict[str, Case] = {
    "mlp": _exported(models.mlp),  # contractions, log-softmax as a reduction and a map, the fused AdamW
    "llama": _exported(lambda directory: models.llama(directory)[0]),  # norms, rotary views, attention, gathers
    "embedding": _embedding,
}


def main(directory: str, names: list[str]) -> int:
    differing = {}
    for name in names:
        path, feeds, options = CASES[name](directory)
        rows = verify_model(path, options, target="adreno830", feeds=feeds)
        differing[name] = [row.name for row in rows if not row.ok] if rows else ["(nothing compared)"]
    print(json.dumps(differing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
