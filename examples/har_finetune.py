"""HAR fine-tuning on the local OpenCL device: T-ResNet pretrained on a source domain, adapted to a shifted one.

    python examples/har_finetune.py [--pretrain-steps 60] [--steps 50] [--out runs/har]

Synthetic sensor windows (97 channels x 60 samples, 17 activity classes): every class is a
mixture of sinusoids on its own group of channels. The target domain shifts it as a new
placement of the sensors would: per-channel gains and offsets, a small time-frequency change
and more noise. Both phases train with AdamW at batch 64 through `fblc compile --target
adreno830` bundles run by the pyopencl runtime; the fine-tuning starts from the pretrained
weights with fresh optimizer state. Accuracy is measured on held-out target windows with
onnxruntime running the inference model with the current weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tresnet import build_tresnet  # noqa: E402

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402

CHANNELS, SAMPLES, CLASSES, BATCH = 97, 60, 17, 64


def sensor_windows(count: int, shifted: bool, seed: int) -> dict[str, np.ndarray]:
    """`count` labelled windows [count, 97, 60, 1] of the source (or the shifted target) domain."""
    rng = np.random.default_rng(seed)
    domain = np.random.default_rng(1234)  # the domain shift itself is fixed
    gains = domain.uniform(0.5, 1.6, CHANNELS) if shifted else np.ones(CHANNELS)
    offsets = domain.normal(0, 0.5, CHANNELS) if shifted else np.zeros(CHANNELS)
    stretch = 1.15 if shifted else 1.0
    noise = 0.6 if shifted else 0.4
    labels = rng.integers(0, CLASSES, count)
    t = np.arange(SAMPLES) / SAMPLES
    x = noise * rng.standard_normal((count, CHANNELS, SAMPLES)).astype(np.float32)
    for row, label in enumerate(labels):
        group = slice(label * 5, label * 5 + 10)
        phase = rng.uniform(0, 2 * np.pi)
        x[row, group] += np.sin(2 * np.pi * (1 + label % 6) * stretch * t + phase)
        x[row, group] += 0.5 * np.sign(np.sin(2 * np.pi * (1 + label // 6) * stretch * t + phase))
    x = x * gains[None, :, None] + offsets[None, :, None]
    return {"x": x[..., None].astype(np.float32), "labels": labels.astype(np.int64)}


def with_weights(model_path: str, weights: dict[str, np.ndarray], out_path: str) -> str:
    """A copy of the ONNX model whose initializers take `weights` (the output of a training run)."""
    model = onnx.load(model_path)
    for tensor in model.graph.initializer:
        if tensor.name in weights:
            tensor.CopyFrom(numpy_helper.from_array(weights[tensor.name].astype(np.float32), tensor.name))
    onnx.save(model, out_path)
    return out_path


def accuracy(model_path: str, data: dict[str, np.ndarray]) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    correct = 0
    for start in range(0, len(data["labels"]) - BATCH + 1, BATCH):
        logits = session.run(None, {"x": data["x"][start:start + BATCH]})[0]
        correct += int((logits.argmax(-1) == data["labels"][start:start + BATCH]).sum())
    return correct / (len(data["labels"]) // BATCH * BATCH)


def train(model_path: str, bundle: str, data: dict[str, np.ndarray], steps: int, lr: float, label: str) -> tuple[
        list[float], dict[str, np.ndarray]]:
    options = TrainingOptions(loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=lr, weight_decay=1e-2))
    compile_model(model_path, bundle, "adreno830", "fp32", options)
    runner = LocalRunner(bundle)
    losses = []
    batches = len(data["labels"]) // BATCH
    for step in range(steps):
        k = step % batches
        started = time.perf_counter()
        losses.append(runner.step({name: array[k * BATCH:(k + 1) * BATCH] for name, array in data.items()}))
        print(f"{label} step {step + 1:3d}  loss {losses[-1]:.4f}  ({time.perf_counter() - started:.2f} s)", flush=True)
    return losses, runner.parameters()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=60, help="steps on the source domain (default 60)")
    parser.add_argument("--steps", type=int, default=50, help="fine-tuning steps on the target domain (default 50)")
    parser.add_argument("--out", default="runs/har", help="output folder (default runs/har)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    source = sensor_windows(BATCH * 8, shifted=False, seed=0)
    target_train = sensor_windows(BATCH * 4, shifted=True, seed=1)
    target_test = sensor_windows(BATCH * 4, shifted=True, seed=2)
    model = build_tresnet(os.path.join(args.out, "tresnet.onnx"), batch=BATCH)

    _, pretrained = train(model, os.path.join(args.out, "source_bundle"), source, args.pretrain_steps, 3e-3, "source")
    pretrained_model = with_weights(model, pretrained, os.path.join(args.out, "tresnet_source.onnx"))
    before = accuracy(pretrained_model, target_test)
    print(f"source accuracy {accuracy(pretrained_model, sensor_windows(BATCH * 2, False, 3)):.3f}; "
          f"target accuracy before fine-tuning {before:.3f}")

    losses, tuned = train(pretrained_model, os.path.join(args.out, "target_bundle"), target_train, args.steps, 1e-3,
                          "target")
    after = accuracy(with_weights(model, tuned, os.path.join(args.out, "tresnet_target.onnx")), target_test)
    print(f"target loss {losses[0]:.4f} -> {losses[-1]:.4f} ({losses[-1] / losses[0]:.2f} x); "
          f"target accuracy {before:.3f} -> {after:.3f}")
    ok = losses[-1] < 0.5 * losses[0] and after > before
    print("fine-tuning met its goals" if ok else "fine-tuning did NOT meet its goals (loss halved, accuracy up)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
