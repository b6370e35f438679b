"""Import + training-graph build time: the test models and a Llama-3.2-1B-shaped decoder.

    python benchmarks/graph_build.py [--repeats 5] [--skip-exports]

For each model: median wall time of reading the file, of the import passes (static shapes,
folding, shape inference) and of the training passes (trainable split, loss, autodiff,
AdamW), over `--repeats` fresh builds. The 1B-shaped decoder (16 layers, hidden 2048, FFN
8192, 32/8 heads, vocab 128256, sequence 256) keeps its 1.2 G weights in a sparse external
file that is never read; its whole build must stay under 1 s (the last line gives the ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.llama_shaped import LLAMA_3_2_1B, build_llama_shaped  # noqa: E402
from fblc.compiler.model_io import load_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, import_passes, run_passes, training_passes  # noqa: E402

TARGET_SECONDS = 1.0


def time_build(path: str, options: TrainingOptions, repeats: int) -> tuple[float, float, float, int]:
    """Median seconds of (read, import passes, training passes) and the step's node count."""
    reads, imports, trainings = [], [], []
    nodes = 0
    for _ in range(repeats):
        started = time.perf_counter()
        model = load_model(path)
        read = time.perf_counter()
        model = run_passes(model, import_passes(options))
        imported = time.perf_counter()
        model = run_passes(model, training_passes(options))
        done = time.perf_counter()
        reads.append(read - started)
        imports.append(imported - read)
        trainings.append(done - imported)
        nodes = len(model.graph)
    return statistics.median(reads), statistics.median(imports), statistics.median(trainings), nodes


def exported_models(directory: str) -> list[tuple[str, str, dict[str, tuple[int, ...]], str]]:
    """(name, path, input shapes, loss) of the models the tests train; exports need torch + transformers."""
    from tests.support import models

    found = []
    exports: list[Callable[[str], object]] = [models.mlp, models.tresnet, models.resnet_legacy,
                                              models.resnet_dynamo_optimized, models.mobilenet_v2]
    for build in exports:
        exported = build(directory)
        found.append((exported.name, exported.path, exported.input_shapes, "cross_entropy"))
    for exported in models.llama(directory):
        found.append((exported.name, exported.path, exported.input_shapes, "cross_entropy"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-exports", action="store_true", help="only the 1B-shaped decoder (no torch needed)")
    args = parser.parse_args()
    optimizer = OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        models = [] if args.skip_exports else exported_models(directory)
        llama_path = build_llama_shaped(os.path.join(directory, "llama_1b_shaped.onnx"))
        models.append(("llama-3.2-1b-shaped", llama_path, {}, "cross_entropy"))
        for name, path, shapes, loss in models:
            options = TrainingOptions(input_shapes=shapes, loss=loss, optimizer=optimizer)
            read, imports, training, nodes = time_build(path, options, args.repeats)
            rows.append((name, read, imports, training, nodes))
    print(f"{'model':<22} {'read s':>8} {'import s':>9} {'train-graph s':>14} {'total s':>8} {'step nodes':>11}")
    for name, read, imports, training, nodes in rows:
        print(f"{name:<22} {read:8.3f} {imports:9.3f} {training:14.3f} {read + imports + training:8.3f} {nodes:11d}")
    name, read, imports, training, _ = rows[-1]
    total = read + imports + training
    shape = LLAMA_3_2_1B
    print(f"\n{name} ({shape.layers} layers, hidden {shape.hidden}, FFN {shape.ffn}, {shape.heads}/{shape.kv_heads} "
          f"heads, vocab {shape.vocab}, seq {shape.seq}): median build {total:.3f} s = {total / TARGET_SECONDS:.2f} x "
          f"the {TARGET_SECONDS:.0f} s target ({'met' if total < TARGET_SECONDS else 'MISSED'})")
    return 0 if total < TARGET_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
