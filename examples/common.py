"""What fblc's example builders share: writing a checked opset-18 classifier model."""

from __future__ import annotations

import argparse
from typing import Sequence

import onnx
from onnx import TensorProto, helper

OPSET = 18
INPUT = "x"
OUTPUT = "logits"


def positive_int(text: str) -> int:
    """argparse type of a size: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def write_classifier(path: str, name: str, nodes: Sequence[onnx.NodeProto], input_shape: Sequence[int],
                     output_shape: Sequence[int], initializers: Sequence[onnx.TensorProto]) -> str:
    """Save `x -> logits` as a checked ONNX file at `path`; returns `path`."""
    graph = helper.make_graph(
        list(nodes), name,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, list(input_shape))],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, list(output_shape))],
        list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="fblc.examples")
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path
