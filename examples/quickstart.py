"""Quickstart: build T-ResNet, compile its training step for adreno830, train it 20 steps on the local OpenCL device.

    python examples/quickstart.py [--steps 20] [--batch 16] [--out runs/quickstart]

Steps: write T-ResNet as ONNX (examples/tresnet.py); `fblc compile` it with AdamW for the
adreno830 target into a bundle of OpenCL image2d_t kernels; `fblc run` the bundle on the
local device (PoCL on the CPU unless another OpenCL device is set) on synthetic sensor
windows, printing the loss per step (the first run also builds the kernels, 15-30 s on PoCL,
with a line of progress every few seconds) and its closing line (steps, first and last loss);
then where the bundle is and how to train again keeping the parameters (this run does not).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tresnet import build_tresnet  # noqa: E402

from fblc.cli import main as fblc  # noqa: E402

CHANNELS, SAMPLES, CLASSES = 97, 60, 17


def sensor_batch(batch: int, seed: int) -> dict[str, np.ndarray]:
    """Windows where each class is a sinusoid of its own frequency on its own channel group, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, batch)
    t = np.arange(SAMPLES) / SAMPLES
    x = 0.3 * rng.standard_normal((batch, CHANNELS, SAMPLES, 1)).astype(np.float32)
    for row, label in enumerate(labels):
        x[row, label * 5:label * 5 + 8, :, 0] += np.sin(2 * np.pi * (label + 1) * t + rng.uniform(0, 2 * np.pi))
    return {"x": x, "labels": labels.astype(np.int64)}


def summary(steps: int, bundle: str, data: str) -> str:
    """What the quickstart ends with, after `fblc run`'s own closing line (steps and losses): where the bundle
    is and the command that trains again and keeps the parameters (this run does not)."""
    trained = os.path.join(os.path.dirname(bundle), "trained.npz")
    return "\n".join([
        f"bundle: {bundle}/ (its kernels are cached now: a second run starts at once)",
        f"train again and keep the parameters: fblc run {bundle} --data {data} --steps {steps} --save-params {trained}",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--batch", type=int, default=16, help="batch size the model is compiled for (default 16)")
    parser.add_argument("--out", default="runs/quickstart",
                        help="folder for the model, data and bundle (default runs/quickstart)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = build_tresnet(os.path.join(args.out, "tresnet.onnx"), batch=args.batch)
    data = os.path.join(args.out, "sensor.npz")
    np.savez(data, **sensor_batch(args.batch, seed=0))
    bundle = os.path.join(args.out, "tresnet.adreno830")
    code = fblc(["compile", model, "--target", "adreno830", "-o", bundle, "--optimizer", "adamw", "--lr", "3e-3",
                 "--weight-decay", "1e-2"])
    if code:
        return code
    code = fblc(["run", bundle, "--device", "local", "--steps", str(args.steps), "--data", data])
    if code == 0:
        print(summary(args.steps, bundle, data))
    return code


if __name__ == "__main__":
    sys.exit(main())
