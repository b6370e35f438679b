"""Broken model files for the fuzzer: each mutation turns a valid model into bytes a user might hand fblc.

Truncated, bytes flipped, a dangling input, a cycle, a type that cannot be, an unknown op, an attribute of the
wrong type, an empty graph. fblc.tools.fuzz loads each and builds its training step: it must build or raise an
FblcError, never crash.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

Mutation = Callable[[onnx.ModelProto, np.random.Generator], bytes]


def _proto(model: onnx.ModelProto) -> onnx.ModelProto:
    return onnx.ModelProto.FromString(model.SerializeToString())


def _truncated(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    data = model.SerializeToString()
    return data[: int(rng.integers(0, len(data)))]


def _flipped(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    data = bytearray(model.SerializeToString())
    for index in rng.integers(0, len(data), size=int(rng.integers(1, 8))):
        data[index] ^= int(rng.integers(1, 256))
    return bytes(data)


def _with_inputs(m: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes that read a tensor (not the Constants)."""
    return [node for node in m.graph.node if node.input]


def _dangling(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    m = _proto(model)
    readers = _with_inputs(m)
    node = readers[int(rng.integers(len(readers)))]
    node.input[int(rng.integers(len(node.input)))] = "no_such_tensor"
    return m.SerializeToString()


def _cycle(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    m = _proto(model)
    first, last = _with_inputs(m)[0], m.graph.node[len(m.graph.node) - 1]
    first.input[0] = last.output[0]
    return m.SerializeToString()


def _bad_type(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    m = _proto(model)
    m.graph.input[0].type.tensor_type.elem_type = int(rng.choice([onnx.TensorProto.STRING, onnx.TensorProto.BOOL,
                                                                  onnx.TensorProto.INT8]))
    return m.SerializeToString()


def _unknown_op(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    m = _proto(model)
    m.graph.node[int(rng.integers(len(m.graph.node)))].op_type = "NoSuchOp"
    return m.SerializeToString()


def _bad_attribute(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    m = _proto(model)
    node = m.graph.node[len(m.graph.node) - 1]  # the final Gemm
    node.attribute.append(onnx.helper.make_attribute("transA", 0.5))
    return m.SerializeToString()


def _empty(model: onnx.ModelProto, rng: np.random.Generator) -> bytes:
    m = _proto(model)
    del m.graph.node[:]
    return m.SerializeToString()


MUTATIONS: dict[str, Mutation] = {"truncated": _truncated, "flipped": _flipped, "dangling": _dangling,
                                  "cycle": _cycle, "bad type": _bad_type, "unknown op": _unknown_op,
                                  "bad attribute": _bad_attribute, "empty graph": _empty}


def mutant(model: onnx.ModelProto, seed: int) -> tuple[str, bytes]:
    """(kind, bytes): the mutation picked by `seed` (kinds in turn, sorted by name) applied to `model`."""
    kinds = sorted(MUTATIONS)
    kind = kinds[seed % len(kinds)]
    return kind, MUTATIONS[kind](model, np.random.default_rng(seed))
