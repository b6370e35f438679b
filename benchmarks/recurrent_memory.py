"""Recurrent layers unrolled (passes/lower_recurrent.py): launches and saved bytes of one training step.

    PYTHONPATH=$PWD python benchmarks/recurrent_memory.py --steps 16 --target adreno830

For nn.GRU and nn.LSTM (legacy export, batch_first, a linear head on the last step; the human-activity-
recognition shape by default: batch 8, 9 sensor channels, hidden 32), and a Conv2d front + GRU with and without
`--adapter memflora`: fblc compile's launches per step, distinct kernels, and the memory report's saved bytes,
also per time step and in units of one [batch, hidden] fp32 tensor (how many of a step's values the backward
keeps). Compile only, no kernel runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.adapters import AdapterConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402

CHANNELS, CLASSES = 9, 6


class Recurrent(torch.nn.Module):
    """[B, T, 9] -> (Conv2d over time, optional) -> GRU/LSTM -> linear head on the last step."""

    def __init__(self, kind: str, hidden: int, conv: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 16, (3, CHANNELS), padding=(1, 0)) if conv else None
        self.rnn = getattr(torch.nn, kind)(16 if conv else CHANNELS, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv is not None:  # x [B, 4, T, 9]: four sensors' 9 channels
            x = torch.relu(self.conv(x)).squeeze(3).transpose(1, 2)
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


def measure(kind: str, conv: bool, adapter: str, steps: int, batch: int, hidden: int, target: str,
            folder: str) -> dict[str, object]:
    path = os.path.join(folder, f"{kind}_{conv}.onnx")
    x = torch.randn(batch, 4, steps, CHANNELS) if conv else torch.randn(batch, steps, CHANNELS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Recurrent(kind, hidden, conv).eval(), (x,), path, dynamo=False, do_constant_folding=False,
                          opset_version=18, input_names=["x"], output_names=["logits"])
    options = TrainingOptions(adapter=AdapterConfig(adapter, rank=2))
    _, report = compile_model(path, os.path.join(folder, f"bundle_{kind}_{conv}_{adapter}"), target, "fp32", options)
    saved = report["memory"]["saved"]
    return {"model": ("Conv2d+" if conv else "") + kind, "adapter": adapter, "launches": report["launches_per_step"],
            "distinct": report["distinct_kernels"], "saved_B": saved, "saved_per_step_B": saved // steps,
            "BxH_per_step": round(saved / steps / (batch * hidden * 4), 1), "live_peak_B": report["memory"]["live_peak"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--target", default="adreno830")
    args = parser.parse_args(argv)
    cases = [("GRU", False, "none"), ("LSTM", False, "none"), ("GRU", True, "none"), ("GRU", True, "memflora")]
    print(f"T={args.steps} batch={args.batch} hidden={args.hidden} target={args.target}")
    columns = ["model", "adapter", "launches", "distinct", "saved_B", "saved_per_step_B", "BxH_per_step",
               "live_peak_B"]
    print("  ".join(f"{c:>16}" for c in columns))
    with tempfile.TemporaryDirectory() as folder:
        for kind, conv, adapter in cases:
            row = measure(kind, conv, adapter, args.steps, args.batch, args.hidden, args.target, folder)
            print("  ".join(f"{row[c]!s:>16}" for c in columns), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
