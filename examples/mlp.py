"""A small multilayer perceptron as ONNX, built without torch: fblc's own smallest test model.

Hidden layers alternate between the two ways exporters write a linear layer, so both
reach the compiler: `Gemm(x, W, b, transB=1)` with W stored [out, in] like torch.nn.Linear,
and `MatMul(x, W) + b` with W stored [in, out]. Every hidden layer is followed by Relu; the
last layer gives `classes` logits. Weights are float32 from a seeded generator, so a seed
names one model.

    python examples/mlp.py mlp.onnx [--batch 8] [--in-features 32] [--hidden 64,64] [--classes 10] [--seed 0]
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


def _linear_weights(rng: np.random.Generator, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch.nn.Linear's default init (uniform in +-1/sqrt(fan_in)), W as [out, in]."""
    bound = 1.0 / np.sqrt(fan_in)
    weight = rng.uniform(-bound, bound, size=(fan_out, fan_in)).astype(np.float32)
    bias = rng.uniform(-bound, bound, size=(fan_out,)).astype(np.float32)
    return weight, bias


def layer_uses_gemm(index: int) -> bool:
    """Even layers are Gemm (W [out, in]), odd layers MatMul + Add (W [in, out])."""
    return index % 2 == 0


def build_mlp(path: str, batch: int = 8, in_features: int = 32, hidden: Sequence[int] = (64, 64),
              classes: int = 10, seed: int = 0) -> str:
    """Write an opset-18 MLP `x [batch, in_features] -> logits [batch, classes]` to `path`; return `path`.

    Initializers are named `layers.<i>.weight` / `layers.<i>.bias`, as a torch module with a
    `layers` list would name them, so references can load them by name.
    """
    rng = np.random.default_rng(seed)
    widths = [in_features, *hidden, classes]
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    current = INPUT
    last = len(widths) - 2
    for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        weight, bias = _linear_weights(rng, fan_in, fan_out)
        w_name, b_name = f"layers.{index}.weight", f"layers.{index}.bias"
        linear_out = OUTPUT if index == last else f"layers.{index}.out"
        if layer_uses_gemm(index):
            initializers += [numpy_helper.from_array(weight, w_name), numpy_helper.from_array(bias, b_name)]
            nodes.append(helper.make_node("Gemm", [current, w_name, b_name], [linear_out], name=f"layers.{index}.gemm",
                                          transB=1))
        else:
            initializers += [numpy_helper.from_array(np.ascontiguousarray(weight.T), w_name),
                             numpy_helper.from_array(bias, b_name)]
            product = f"layers.{index}.matmul_out"
            nodes.append(helper.make_node("MatMul", [current, w_name], [product], name=f"layers.{index}.matmul"))
            nodes.append(helper.make_node("Add", [product, b_name], [linear_out], name=f"layers.{index}.add"))
        current = linear_out
        if index != last:
            activated = f"layers.{index}.relu_out"
            nodes.append(helper.make_node("Relu", [current], [activated], name=f"layers.{index}.relu"))
            current = activated
    return write_classifier(path, "mlp", nodes, [batch, in_features], [batch, classes], initializers)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", metavar="OUTPUT.onnx", help="where to write the model")
    parser.add_argument("--batch", type=positive_int, default=8, help="batch size of the input x (default 8)")
    parser.add_argument("--in-features", type=positive_int, default=32, help="input features (default 32)")
    parser.add_argument("--hidden", default="64,64", help="hidden widths, comma-separated (default 64,64)")
    parser.add_argument("--classes", type=positive_int, default=10, help="output logits (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    try:
        hidden = tuple(positive_int(width) for width in args.hidden.split(",") if width)
    except argparse.ArgumentTypeError:
        parser.error(f"--hidden takes comma-separated positive integers, not {args.hidden!r}")
    path = build_mlp(args.output, batch=args.batch, in_features=args.in_features, hidden=hidden,
                     classes=args.classes, seed=args.seed)
    model = onnx.load(path)
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    params = sum(int(np.prod(shape)) for shape in shapes.values())
    widths = [shapes["layers.0.weight"][1]] + [shapes[f"layers.{i}.bias"][0] for i in range(len(shapes) // 2)]
    print(f"wrote {path}: MLP {' -> '.join(map(str, widths))} (Gemm and MatMul+Add layers, Relu), "
          f"{len(model.graph.node)} nodes, {params} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
