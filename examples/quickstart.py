"""Quickstart: build T-ResNet, compile its training step, and train it on synthetic sensor data.

    python examples/quickstart.py [--steps 20] [--out runs/quickstart]

Steps: write T-ResNet as ONNX (examples/tresnet.py), run `fblc train-graph` on it (AdamW),
then train with onnxruntime executing the step graph, feeding each step's `.new` tensors
back. OpenCL execution of the same step comes with the bundle and runtime (`fblc compile`,
`fblc run`) once they land; this runs the reference executor they are checked against.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tresnet import build_tresnet  # noqa: E402

from fblc.cli import main as fblc_main  # noqa: E402
from fblc.compiler.reference import ReferenceStep  # noqa: E402

CHANNELS, SAMPLES, CLASSES = 97, 60, 17


def sensor_batch(batch: int, seed: int) -> dict[str, np.ndarray]:
    """Windows where each class is a sinusoid of its own frequency on its own channel group, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, batch)
    t = np.arange(SAMPLES) / SAMPLES
    x = 0.3 * rng.standard_normal((batch, CHANNELS, SAMPLES, 1)).astype(np.float32)
    for row, label in enumerate(labels):
        channels = slice(label * 5, label * 5 + 8)
        x[row, channels, :, 0] += np.sin(2 * np.pi * (label + 1) * t + rng.uniform(0, 2 * np.pi))
    return {"x": x, "labels": labels.astype(np.int64)}


def run(steps: int, out: str, batch: int) -> list[float]:
    os.makedirs(out, exist_ok=True)
    model = build_tresnet(os.path.join(out, "tresnet.onnx"), batch=batch)
    step_path = os.path.join(out, "tresnet_step.onnx")
    code = fblc_main(["train-graph", model, "-o", step_path, "--optimizer", "adamw", "--lr", "3e-3",
                      "--weight-decay", "1e-2"])
    if code:
        raise SystemExit(code)
    trainer = ReferenceStep(step_path)
    data = sensor_batch(batch, seed=0)
    losses = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        losses.append(trainer.step(data))
        print(f"step {step:3d}  loss {losses[-1]:.4f}  ({(time.perf_counter() - started) * 1e3:.0f} ms, onnxruntime)")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="runs/quickstart")
    args = parser.parse_args()
    history = run(args.steps, args.out, args.batch)
    print(f"loss {history[0]:.4f} -> {history[-1]:.4f} over {len(history)} steps")
