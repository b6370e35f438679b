"""A fleet learns scikit-learn's handwritten digits: a small CNN as ONNX (built without torch) and the digits
as the `.npz` `fblc fleet simulate --data` reads.

    python examples/fleet_digits.py runs/fleet/           # writes digits_cnn.onnx and digits.npz there
    fblc compile runs/fleet/digits_cnn.onnx --target adreno830 --optimizer sgd --lr 0.1 -o runs/fleet/full
    fblc train-graph runs/fleet/digits_cnn.onnx --optimizer sgd --lr 0.1 -o runs/fleet/full.step.onnx
    fblc fleet simulate runs/fleet/full --step runs/fleet/full.step.onnx --data runs/fleet/digits.npz \\
         --clients 20 --rounds 10 --partition dirichlet:0.5 --local-steps 5 --device graph -o runs/fleet/sim

The data: 1,797 8 x 8 digits a person wrote (sklearn.datasets.load_digits, inside the package), scaled to [0, 1],
as `pixels` [N, 1, 8, 8] float32 and `labels` int64; with `--rotate DEGREES` the digits turned about their
centre (the shifted task an adapter fleet learns from a model pretrained on upright digits).
The model: Conv 1->32 3x3, Relu, Conv 32->64 3x3 stride 2, Relu, Flatten, Gemm 1024->128, Relu, Gemm 128->10
(151k parameters; benchmarks/adaptation.py's digits CNN twice as wide), torch's default initialisation from a
seeded generator. MemFLoRA and LoRA at rank 2 adapt conv2 (conv1's one input channel is below the rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
INPUT = "pixels"
OUTPUT = "logits"
CLASSES = 10


def _uniform(rng: np.random.Generator, fan_in: int, shape: Sequence[int]) -> np.ndarray:
    """torch's default Conv/Linear initialisation: uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=tuple(shape)).astype(np.float32)


def build_digits_cnn(path: str, batch: int = 16, seed: int = 0) -> str:
    """Write the digits CNN `pixels [batch, 1, 8, 8] -> logits [batch, 10]` to `path`; returns `path`."""
    rng = np.random.default_rng(seed)
    tensors = {"conv1.weight": _uniform(rng, 9, (32, 1, 3, 3)), "conv1.bias": _uniform(rng, 9, (32,)),
               "conv2.weight": _uniform(rng, 288, (64, 32, 3, 3)), "conv2.bias": _uniform(rng, 288, (64,)),
               "fc1.weight": _uniform(rng, 1024, (128, 1024)), "fc1.bias": _uniform(rng, 1024, (128,)),
               "fc2.weight": _uniform(rng, 128, (CLASSES, 128)), "fc2.bias": _uniform(rng, 128, (CLASSES,))}
    nodes = [
        helper.make_node("Conv", [INPUT, "conv1.weight", "conv1.bias"], ["conv1"], name="conv1", pads=[1, 1, 1, 1],
                         kernel_shape=[3, 3]),
        helper.make_node("Relu", ["conv1"], ["relu1"], name="relu1"),
        helper.make_node("Conv", ["relu1", "conv2.weight", "conv2.bias"], ["conv2"], name="conv2",
                         pads=[1, 1, 1, 1], strides=[2, 2], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["conv2"], ["relu2"], name="relu2"),
        helper.make_node("Flatten", ["relu2"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["fc1"], name="fc1", transB=1),
        helper.make_node("Relu", ["fc1"], ["relu3"], name="relu3"),
        helper.make_node("Gemm", ["relu3", "fc2.weight", "fc2.bias"], [OUTPUT], name="fc2", transB=1),
    ]
    graph = helper.make_graph(nodes, "digits_cnn",
                              [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [batch, 1, 8, 8])],
                              [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [batch, CLASSES])],
                              [numpy_helper.from_array(array, name) for name, array in tensors.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="fblc.examples")
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def digits(rotate: float = 0.0) -> dict[str, np.ndarray]:
    """scikit-learn's digits as {pixels [N, 1, 8, 8] float32 in [0, 1], labels [N] int64}, turned by `rotate`
    degrees (bilinear; scipy comes with scikit-learn)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    pixels = (data.images[:, None] / 16.0).astype(np.float32)
    if rotate:
        from scipy import ndimage

        pixels = ndimage.rotate(pixels, rotate, axes=(2, 3), reshape=False, order=1).astype(np.float32)
    return {INPUT: pixels, "labels": data.target.astype(np.int64)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write digits_cnn.onnx and digits.npz")
    parser.add_argument("--batch", type=int, default=16, help="the model's batch (default 16)")
    parser.add_argument("--rotate", type=float, default=0.0, help="turn the digits by DEGREES (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    model = build_digits_cnn(os.path.join(args.folder, "digits_cnn.onnx"), args.batch, args.seed)
    data_path = os.path.join(args.folder, "digits.npz")
    data = digits(args.rotate)
    np.savez(data_path, **data)
    print(f"wrote {model} and {data_path} ({len(data['labels'])} digits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
