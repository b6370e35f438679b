"""A Llama-shaped decoder written straight in ONNX, with weights that are never materialised.

The weights are initializers stored as external data in a sparse file: the model has the
real tensor shapes (and so the real graph-building cost) without gigabytes of memory.
The graph follows what torch.onnx's dynamo exporter writes for transformers' Llama: RMSNorm
as Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul, rotary embeddings with rotate_half, grouped-query
attention with repeated KV heads, a causal mask, SiLU-gated MLP, a tied-free LM head (`tied`: the head reads
the embedding table transposed, as Llama-3.2-1B's `tie_word_embeddings` does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


@dataclass(frozen=True)
class LlamaShape:
    layers: int = 16
    hidden: int = 2048
    ffn: int = 8192
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    seq: int = 256
    batch: int = 1
    tied: bool = False  # the LM head is the embedding table's transpose (one [vocab, hidden] tensor)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_3_2_1B = LlamaShape()


class _Writer:
    def __init__(self, data_name: str) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.data_name = data_name
        self.offset = 0
        self.counter = 0

    def name(self, hint: str) -> str:
        self.counter += 1
        return f"{hint}_{self.counter}"

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"node_{out}", **attrs))
        return out

    def weight(self, name: str, shape: tuple[int, ...]) -> str:
        """A float32 initializer whose bytes live in the (sparse) external data file."""
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        length = int(np.prod(shape)) * 4
        for key, value in (("location", self.data_name), ("offset", str(self.offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.offset += length
        self.initializers.append(tensor)
        return name

    def const(self, array: np.ndarray) -> str:
        name = self.name("const")
        self.initializers.append(numpy_helper.from_array(array, name))
        return name


def _rms_norm(w: _Writer, x: str, weight: str, eps: str, two: str, last: str) -> str:
    variance = w.op("ReduceMean", [w.op("Pow", [x, two]), last], keepdims=1)
    inv = w.op("Reciprocal", [w.op("Sqrt", [w.op("Add", [variance, eps])])])
    return w.op("Mul", [weight, w.op("Mul", [x, inv])])


def _rotary(w: _Writer, x: str, cos: str, sin: str, half: int, dim: int) -> str:
    first = w.op("Slice", [x, w.const(np.array([0])), w.const(np.array([half])), w.const(np.array([3]))])
    second = w.op("Slice", [x, w.const(np.array([half])), w.const(np.array([dim])), w.const(np.array([3]))])
    rotated = w.op("Concat", [w.op("Neg", [second]), first], axis=-1)
    return w.op("Add", [w.op("Mul", [x, cos]), w.op("Mul", [rotated, sin])])


def build_llama_shaped(path: str, shape: LlamaShape = LLAMA_3_2_1B) -> str:
    """Write the decoder to `path` (+ a sparse `path.data`); returns `path`."""
    s = shape
    w = _Writer(os.path.basename(path) + ".data")
    hd, half = s.head_dim, s.head_dim // 2
    two, eps = w.const(np.array(2.0, np.float32)), w.const(np.array(1e-5, np.float32))
    last = w.const(np.array([-1]))
    positions = np.arange(s.seq, dtype=np.float32)[:, None]
    inv_freq = 1.0 / (500000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    angles = np.concatenate([positions * inv_freq] * 2, axis=-1)[None, None]
    cos, sin = w.const(np.cos(angles).astype(np.float32)), w.const(np.sin(angles).astype(np.float32))
    mask = w.const(np.triu(np.full((s.seq, s.seq), -np.inf, np.float32), 1)[None, None])
    scale = w.const(np.array(1.0 / np.sqrt(hd), np.float32))
    heads_shape = lambda n: w.const(np.array([s.batch, s.seq, n, hd]))  # noqa: E731
    group = s.heads // s.kv_heads

    table = w.weight("model.embed_tokens.weight", (s.vocab, s.hidden))
    x = w.op("Gather", [table, "input_ids"])
    for i in range(s.layers):
        p = f"model.layers.{i}"
        h = _rms_norm(w, x, w.weight(f"{p}.input_layernorm.weight", (s.hidden,)), eps, two, last)
        q = w.op("MatMul", [h, w.op("Transpose", [w.weight(f"{p}.self_attn.q_proj.weight", (s.hidden, s.hidden))],
                                   perm=[1, 0])])
        k = w.op("MatMul", [h, w.op("Transpose", [w.weight(f"{p}.self_attn.k_proj.weight", (s.kv_heads * hd, s.hidden))],
                                   perm=[1, 0])])
        v = w.op("MatMul", [h, w.op("Transpose", [w.weight(f"{p}.self_attn.v_proj.weight", (s.kv_heads * hd, s.hidden))],
                                   perm=[1, 0])])
        q = w.op("Transpose", [w.op("Reshape", [q, heads_shape(s.heads)])], perm=[0, 2, 1, 3])
        k = w.op("Transpose", [w.op("Reshape", [k, heads_shape(s.kv_heads)])], perm=[0, 2, 1, 3])
        v = w.op("Transpose", [w.op("Reshape", [v, heads_shape(s.kv_heads)])], perm=[0, 2, 1, 3])
        q, k = _rotary(w, q, cos, sin, half, hd), _rotary(w, k, cos, sin, half, hd)
        repeat = w.const(np.array([s.batch, s.kv_heads, group, s.seq, hd]))
        merged = w.const(np.array([s.batch, s.heads, s.seq, hd]))
        k = w.op("Reshape", [w.op("Expand", [w.op("Unsqueeze", [k, w.const(np.array([2]))]), repeat]), merged])
        v = w.op("Reshape", [w.op("Expand", [w.op("Unsqueeze", [v, w.const(np.array([2]))]), repeat]), merged])
        scores = w.op("Add", [w.op("Mul", [w.op("MatMul", [q, w.op("Transpose", [k], perm=[0, 1, 3, 2])]), scale]),
                              mask])
        attn = w.op("MatMul", [w.op("Softmax", [scores], axis=-1), v])
        attn = w.op("Reshape", [w.op("Transpose", [attn], perm=[0, 2, 1, 3]),
                                w.const(np.array([s.batch, s.seq, s.hidden]))])
        o = w.op("MatMul", [attn, w.op("Transpose", [w.weight(f"{p}.self_attn.o_proj.weight", (s.hidden, s.hidden))],
                                       perm=[1, 0])])
        x = w.op("Add", [x, o])
        h = _rms_norm(w, x, w.weight(f"{p}.post_attention_layernorm.weight", (s.hidden,)), eps, two, last)
        gate = w.op("MatMul", [h, w.op("Transpose", [w.weight(f"{p}.mlp.gate_proj.weight", (s.ffn, s.hidden))],
                                      perm=[1, 0])])
        up = w.op("MatMul", [h, w.op("Transpose", [w.weight(f"{p}.mlp.up_proj.weight", (s.ffn, s.hidden))],
                                    perm=[1, 0])])
        act = w.op("Mul", [w.op("Mul", [gate, w.op("Sigmoid", [gate])]), up])
        down = w.op("MatMul", [act, w.op("Transpose", [w.weight(f"{p}.mlp.down_proj.weight", (s.hidden, s.ffn))],
                                        perm=[1, 0])])
        x = w.op("Add", [x, down])
    x = _rms_norm(w, x, w.weight("model.norm.weight", (s.hidden,)), eps, two, last)
    head = table if s.tied else w.weight("lm_head.weight", (s.vocab, s.hidden))
    w.op("MatMul", [x, w.op("Transpose", [head], perm=[1, 0])])
    w.nodes[-1].output[0] = "logits"  # the graph output keeps the exporter's name
    graph = helper.make_graph(
        w.nodes, "llama_shaped",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [s.batch, s.seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [s.batch, s.seq, s.vocab])],
        initializer=w.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="fblc-benchmark")
    with open(path + ".data", "wb") as data:
        data.truncate(w.offset)  # sparse: no weight byte is ever written
    onnx.save(model, path)
    return path
