"""Forward-only training side by side: memory and learning of FuRA-S ES against the other trainers.

    python benchmarks/fura_s.py [--iterations 40] [--pairs 8] [--target adreno830] [--large]

Table 1 (memory): for each model and trainer, the trainable values and report.json's planned
device peak (`memory.device_peak`) of the compiled bundle, its kernels (the plan's launches; an ES step's members
are one forward its loop repeats) and the launches a step enqueues, and compile time (with
`--large` also the Llama-3.2-1B-shaped decoder of benchmarks/llama_shaped.py, batch 1, T=256);
"n/a" where the adapter has no site (MemFLoRA adapts Conv layers, FuRA-S MatMul/Gemm layers, LoRA
Conv layers, or MatMul/Gemm layers in a model without an eligible conv).
Table 2 (learning): ES steps of the ONNX step (onnxruntime, ReferenceStep) on one fixed batch of
a small MLP classifier with random labels, which nobody tuned for: FuRA-S ES against ES over LoRA
adapters (rank 2 at every linear layer) and full-parameter ES at the same number of forward
passes; the loss before and after, and the fraction of perturbed members that beat the
unperturbed model (MobileSpec's Figure 4b), averaged over the iterations.
Settings, fixed before any run: lr 1 everywhere (ES at Scale's alpha = 1, the paper's Table A2);
sigma in the units of the values perturbed: FuRA-S's delta is a relative change of singular
values (0.05, near the paper's mu = 3e-2), full ES and LoRA ES perturb weight entries themselves
(0.01). At init, LoRA's 0.01 moves this batch's logits by an RMS of 0.022 and full ES's by 0.023
(FuRA-S's 0.05: 0.008), so the two weight-space rows perturb the function alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.compiler.es import EsConfig  # noqa: E402
from fblc.compiler.model_io import load_model, save_model_atomically  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.compiler.reference import ReferenceStep  # noqa: E402
from fblc.errors import FblcError  # noqa: E402
from fblc.passes.pipeline import TrainingOptions, build_training_graph  # noqa: E402
from tests.support import models  # noqa: E402

TRAINERS = {
    "fura-s ES": lambda shapes: TrainingOptions(input_shapes=shapes, trainer="es",
                                                adapter=AdapterConfig(kind="fura-s", block=16)),
    "full ES": lambda shapes: TrainingOptions(input_shapes=shapes, trainer="es"),
    "memflora": lambda shapes: TrainingOptions(input_shapes=shapes, adapter=AdapterConfig(kind="memflora")),
    "lora ES": lambda shapes: TrainingOptions(input_shapes=shapes, trainer="es", adapter=AdapterConfig(kind="lora")),
    "lora": lambda shapes: TrainingOptions(input_shapes=shapes, adapter=AdapterConfig(kind="lora")),
    "full backprop": lambda shapes: TrainingOptions(input_shapes=shapes),
}


#: the trainers of the Llama-3.2-1B-shaped rows (--large): full ES is left out, its 2P + 1 perturbed
#: copies of 1.2 B parameters are what FuRA-S avoids, and each compile here takes minutes
LARGE_TRAINERS = ("fura-s ES", "lora ES", "lora", "full backprop")


def memory_table(directory: str, target: str, large: bool = False) -> list[str]:
    llama, _ = models.llama(directory)
    cases = [("llama 2L B=2 T=16", llama.path, list(TRAINERS)),
             ("mobilenetv2 [1,3,32,32]", _mobilenet(directory), list(TRAINERS))]
    if large:  # weights never materialised (a sparse file), real shapes: 16 layers, 128,256 tokens, T=256
        from benchmarks.llama_shaped import build_llama_shaped

        cases.append(("llama-3.2-1B-shaped B=1 T=256", build_llama_shaped(os.path.join(directory, "llama1b.onnx")),
                      list(LARGE_TRAINERS)))
    rows = ["| model | trainer | trainable values | device peak MB | kernels | launches / step | compile s |",
            "|---|---|---|---|---|---|---|"]
    for name, path, trainers in cases:
        for trainer in trainers:
            started = time.perf_counter()
            try:
                _, report = compile_model(path, os.path.join(directory, "bundle"), target, "fp32",
                                          TRAINERS[trainer]({}))
            except FblcError as error:
                rows.append(f"| {name} | {trainer} | n/a ({error.cause[:70]}) | | | | |")
                continue
            values = sum(int(np.prod(t["shape"])) for t in report["trained"]["tensors"])
            rows.append(f"| {name} | {trainer} | {values:,} | {report['memory']['device_peak'] / 1e6:.2f} | "
                        f"{report['kernels']} | {report['launches_per_step']} | {time.perf_counter() - started:.1f} |")
            print(f"  {name}: {trainer}", file=sys.stderr, flush=True)
    return rows


def _mobilenet(directory: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    module = models.logits_only(transformers.MobileNetV2ForImageClassification(
        transformers.MobileNetV2Config(num_labels=10, image_size=32)), "pixel_values").eval()
    path = os.path.join(directory, "mobilenet_v2.onnx")
    models._quiet_dynamo_export(module, (torch.zeros(1, 3, 32, 32),)).save(path)
    return path


def learning_table(directory: str, iterations: int, pairs: int) -> list[str]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from mlp import build_mlp

    path = build_mlp(os.path.join(directory, "mlp.onnx"), batch=32, in_features=32, hidden=(64, 64), classes=8)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((32, 32)).astype(np.float32), "labels": rng.integers(0, 8, 32)}
    variants = {"fura-s ES (sigma 0.05, lr 1)": TrainingOptions(
                    trainer="es", adapter=AdapterConfig(kind="fura-s", block=16),
                    es=EsConfig(pairs=pairs, sigma=0.05), optimizer=OptimizerConfig("sgd", lr=1.0)),
                "LoRA ES, r 2 (sigma 0.01, lr 1)": TrainingOptions(
                    trainer="es", adapter=AdapterConfig(kind="lora", rank=2),
                    es=EsConfig(pairs=pairs, sigma=0.01), optimizer=OptimizerConfig("sgd", lr=1.0)),
                "full ES (sigma 0.01, lr 1)": TrainingOptions(
                    trainer="es", es=EsConfig(pairs=pairs, sigma=0.01), optimizer=OptimizerConfig("sgd", lr=1.0))}
    rows = ["| trainer | trainable values | forwards | loss before | loss after | members beating the base |",
            "|---|---|---|---|---|---|"]
    for name, options in variants.items():
        step = build_training_graph(load_model(path), options)
        step_path = os.path.join(directory, "step.onnx")
        save_model_atomically(step, step_path)
        reference = ReferenceStep(step_path)
        values = sum(int(np.prod(v.shape)) for v in step.graph.inputs if v.metadata_props.get("fblc.role") == "param")
        losses, better = [], []
        for _ in range(iterations):
            losses.append(reference.step(feeds))
            better.append(float(np.mean(reference.last["rewards"] > -losses[-1])))
        rows.append(f"| {name} | {values:,} | {iterations * (2 * pairs + 1)} | {losses[0]:.4f} | {losses[-1]:.4f} | "
                    f"{np.mean(better):.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--target", default="adreno830")
    parser.add_argument("--large", action="store_true",
                        help="also the Llama-3.2-1B-shaped decoder's memory rows (about 10 minutes, 22 GB of "
                             "host memory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        print("\n".join(learning_table(directory, args.iterations, args.pairs)))
        print()
        print("\n".join(memory_table(directory, args.target, args.large)))


if __name__ == "__main__":
    main()
