"""T-ResNet (the temporal ResNet of the MemFLoRA tables) as ONNX, built without torch.

Shape as MemFLoRA's public code uses it: a sensor window is an input [B, C, T, 1] (C sensor
channels, T samples); 3 residual blocks with 64 -> 128 -> 128 maps, each conv(8,1)-BN-ReLU,
conv(5,1)-BN-ReLU, conv(3,1)-BN, a shortcut that is a 1x1 conv + BN when the channel count
changes and the identity otherwise, then ReLU(x + residual); then GlobalAveragePool, Flatten
and a Linear (Gemm) to `classes` logits.

Temporal convs keep the length, padded like torch's padding='same' (for the even kernel 8:
3 before, 4 after). Convs carry a bias, as in the original Keras T-ResNet (Conv1D's
default). BatchNormalization is in inference form with non-trivial random running
statistics, gamma and beta, so a training graph that runs BN in eval mode has real scales
to get right. Weights are float32 from a seeded generator.

    python examples/tresnet.py tresnet.onnx [--batch 4] [--channels 97] [--samples 60] [--classes 17] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import INPUT, OUTPUT, positive_int, write_classifier  # noqa: E402

BLOCK_MAPS = (64, 128, 128)
KERNELS = (8, 5, 3)
BN_EPSILON = 1e-5


def same_pads(kernel: int) -> tuple[int, int]:
    """Padding before/after that keeps the length at stride 1, as torch's padding='same' splits it."""
    total = kernel - 1
    return total // 2, total - total // 2


class _Builder:
    """Accumulates nodes and initializers under torch-style names (`blocks.0.conv1.weight`)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def tensor(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def conv(self, prefix: str, x: str, c_in: int, c_out: int, kernel: int) -> str:
        """Conv (kernel, 1) with torch's default init, same padding along time."""
        bound = 1.0 / np.sqrt(c_in * kernel)
        weight = self.tensor(f"{prefix}.weight", self.rng.uniform(-bound, bound, (c_out, c_in, kernel, 1)))
        bias = self.tensor(f"{prefix}.bias", self.rng.uniform(-bound, bound, (c_out,)))
        before, after = same_pads(kernel)
        out = f"{prefix}.out"
        self.nodes.append(helper.make_node("Conv", [x, weight, bias], [out], name=prefix, kernel_shape=[kernel, 1],
                                           pads=[before, 0, after, 0], strides=[1, 1], dilations=[1, 1], group=1))
        return out

    def batch_norm(self, prefix: str, x: str, channels: int) -> str:
        """Inference-form BatchNormalization with random, non-trivial statistics and affine terms."""
        rng = self.rng
        inputs = [x,
                  self.tensor(f"{prefix}.weight", rng.uniform(0.5, 1.5, channels)),
                  self.tensor(f"{prefix}.bias", rng.normal(0.0, 0.1, channels)),
                  self.tensor(f"{prefix}.running_mean", rng.normal(0.0, 0.1, channels)),
                  self.tensor(f"{prefix}.running_var", rng.uniform(0.5, 1.5, channels))]
        out = f"{prefix}.out"
        self.nodes.append(helper.make_node("BatchNormalization", inputs, [out], name=prefix, epsilon=BN_EPSILON))
        return out

    def unary(self, op_type: str, name: str, *inputs: str) -> str:
        out = f"{name}.out"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name))
        return out

    def block(self, prefix: str, x: str, c_in: int, c_out: int) -> str:
        h = x
        for index, kernel in enumerate(KERNELS, start=1):
            h = self.conv(f"{prefix}.conv{index}", h, c_in if index == 1 else c_out, c_out, kernel)
            h = self.batch_norm(f"{prefix}.bn{index}", h, c_out)
            if index < len(KERNELS):
                h = self.unary("Relu", f"{prefix}.relu{index}", h)
        shortcut = x
        if c_in != c_out:
            shortcut = self.conv(f"{prefix}.shortcut.conv", x, c_in, c_out, 1)
            shortcut = self.batch_norm(f"{prefix}.shortcut.bn", shortcut, c_out)
        total = self.unary("Add", f"{prefix}.add", shortcut, h)
        return self.unary("Relu", f"{prefix}.relu_out", total)


def build_tresnet(path: str, batch: int = 4, channels: int = 97, samples: int = 60, classes: int = 17,
                  seed: int = 0) -> str:
    """Write an opset-18 T-ResNet `x [batch, channels, samples, 1] -> logits [batch, classes]`; return `path`.

    Initializer names follow a torch module layout (`blocks.<i>.conv1.weight`,
    `blocks.<i>.bn1.running_var`, `blocks.<i>.shortcut.conv.weight`, `fc.weight`), so a torch
    reference can load them by name.
    """
    b = _Builder(seed)
    h = INPUT
    c_in = channels
    for index, c_out in enumerate(BLOCK_MAPS):
        h = b.block(f"blocks.{index}", h, c_in, c_out)
        c_in = c_out
    pooled = b.unary("GlobalAveragePool", "pool", h)
    flat = "flatten.out"
    b.nodes.append(helper.make_node("Flatten", [pooled], [flat], name="flatten", axis=1))
    bound = 1.0 / np.sqrt(c_in)
    weight = b.tensor("fc.weight", b.rng.uniform(-bound, bound, (classes, c_in)))
    bias = b.tensor("fc.bias", b.rng.uniform(-bound, bound, (classes,)))
    b.nodes.append(helper.make_node("Gemm", [flat, weight, bias], [OUTPUT], name="fc", transB=1))
    return write_classifier(path, "tresnet", b.nodes, [batch, channels, samples, 1], [batch, classes], b.initializers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", metavar="OUTPUT.onnx", help="where to write the model")
    parser.add_argument("--batch", type=positive_int, default=4, help="batch size of the input x (default 4)")
    parser.add_argument("--channels", type=positive_int, default=97, help="sensor channels C (default 97)")
    parser.add_argument("--samples", type=positive_int, default=60, help="samples per window T (default 60)")
    parser.add_argument("--classes", type=positive_int, default=17, help="output logits (default 17)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    path = build_tresnet(args.output, batch=args.batch, channels=args.channels, samples=args.samples,
                         classes=args.classes, seed=args.seed)
    model = onnx.load(path)
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    classes = model.graph.output[0].type.tensor_type.shape.dim[1].dim_value
    print(f"wrote {path}: T-ResNet input {'x'.join(map(str, dims))}, blocks {BLOCK_MAPS}, {classes} classes, "
          f"{len(model.graph.node)} nodes, {params} values in initializers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
