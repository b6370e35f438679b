"""quantize_weights: store frozen MatMul/Gemm and Conv weights and Gather tables as int8/int4 groups or fp16 (--weights).

Rewrite, with --weights int8|int4: each `frozen` float 2-D initializer W that is read only as the B operand
of MatMul or Gemm (directly, or through Transpose perm [1, 0]: the dynamo exporter's Linear) or as a Gather's
table (an embedding; a tied LM head reads it as both) becomes
DequantizeLinear(q, scale, axis=a, block_size=g) (opset 21) in W's place: q the signed integers
(fblc.compiler.quantize, groups of --weight-group along the contractions' reduction axis a, or for a table only
gathered, along its rows: a gathered row dequantizes from its own words and scales), scale float32 values that fp16
holds exactly, stored as fp16 on the device (`fblc.storage`). With --weights fp16: W's values are rounded to fp16
(still a float tensor, so the graph and onnxruntime compute with what the device holds) and stored in a half
texture, which its contractions read as any float texture: no Cast, no float copy. Never a trainable weight (role `param`) and never an adapter's factor (LoRA A/B,
MemFLoRA P/U, FuRA-S R: `fblc.adapter_factor`, set where adapters make them). Each quantized weight's
relative Frobenius error ||W - deq(q)|| / ||W|| is recorded in the model metadata (`fblc.quantized`), which
report.json gives. A frozen Conv weight W [C_out, C_in / group, k..] read only by Convs becomes
DequantizeLinear(q, scale) in W's shape: groups of g input channels at one tap (axis 1), or one scale per output
channel (axis 0) where C_in / group < g (_quantize_conv). The default domain's opset rises to 21 where it was
lower (the blocked form).
Preconditions: roles final (mark_trainable); static shapes. In place; `modified` when a weight was rewritten.
"""

from __future__ import annotations

import contextlib
import json
from typing import Callable, Iterator

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.quantize import (INT_FORMATS, STORED_AS, WeightFormat, dequantize, group_of, quantize,
                                   quantize_with_error)
from fblc.compiler.values import attr, static_shape
from fblc.compiler.weight_data import HalfRounded, MappedConstant, flat_pieces
from fblc.passes.contracts import ContractPass

QUANTIZED, ADAPTER_FACTOR = keys.QUANTIZED, keys.ADAPTER_FACTOR
BLOCKED_OPSET = 21  # DequantizeLinear's block_size
#: elements of a weight read between drops of its pages (_quantize_in_slices: bounded host memory)
SLICE_ELEMENTS = 1 << 22
#: elements quantize_with_error takes at a time within a slice: its ~10 passes over them stay in the CPU's cache
#: (the weight's pages are still handed back a slice at a time: each drop walks the whole mapping)
CACHED_ELEMENTS = 1 << 17


def _reduction_axis(use: ir.Usage) -> int | None:
    """The axis of the stored 2-D weight that `use` reduces over, where `use` reads it as a contraction's B
    (MatMul's [K, N] input 1, Gemm's input 1 by transB, or either through Transpose perm [1, 0]); else None."""
    node, transposed = use.node, False
    if node.op_type == "Transpose" and node.domain == "" and list(attr(node, "perm", [1, 0])) == [1, 0]:
        readers = node.outputs[0].uses()
        if len(readers) != 1:
            return None
        node, transposed = readers[0].node, True
        use = readers[0]
    if node.domain != "" or use.idx != 1 or node.op_type not in ("MatMul", "Gemm"):
        return None
    if node.op_type == "Gemm":
        transposed ^= bool(int(attr(node, "transB", 0)))
    return 1 if transposed else 0


def _gathered_axis(use: ir.Usage) -> int | None:
    """The axis of the stored 2-D table that a Gather reading it as its data (input 0) keeps whole: the row of an
    embedding (Gather axis 0 keeps axis 1), so that each gathered row dequantizes from its own words and scales;
    else None."""
    node = use.node
    if node.op_type != "Gather" or node.domain != "" or use.idx != 0:
        return None
    return 1 - int(attr(node, "axis", 0)) % 2


def _candidate(value: ir.Value) -> int | None:
    """The axis the groups of a frozen float weight run along, where only contractions (as B) and Gathers (as
    the table) read it: the contractions' reduction axis (one for all), else the gathered rows' axis (a Gather
    dequantizes any grouping element by element: a tied embedding / LM head takes the head's); else None."""
    if keys.get_role(value) != Role.FROZEN.value or value.const_value is None or ADAPTER_FACTOR in value.metadata_props:
        return None
    if value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16) or len(static_shape(value)) != 2:
        return None
    if value.is_graph_input() or value.is_graph_output() or not value.uses():
        return None
    gathers = [use for use in value.uses() if _gathered_axis(use) is not None]
    contractions = [use for use in value.uses() if _gathered_axis(use) is None]
    axes = {_reduction_axis(use) for use in contractions} or {_gathered_axis(use) for use in gathers}
    return axes.pop() if len(axes) == 1 and None not in axes else None


def _conv_candidate(value: ir.Value) -> bool:
    """Whether `value` is a frozen float Conv weight [C_out, C_in / group, k..] that only Convs read (input 1)."""
    if keys.get_role(value) != Role.FROZEN.value or value.const_value is None or ADAPTER_FACTOR in value.metadata_props:
        return False
    if value.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16) or len(static_shape(value)) < 3:
        return False
    if value.is_graph_input() or value.is_graph_output() or not value.uses():
        return False
    return all(use.node.op_type == "Conv" and use.node.domain == "" and use.idx == 1 for use in value.uses())


def _quantize_conv(graph: ir.Graph, weight: ir.Value, weights: WeightFormat) -> dict:
    """Conv weight W [C_out, C_in / group, k..] as DequantizeLinear(q, scale) in W's own shape (no view between
    the weight and its convs, whose kernels read it dequantized as they load it: fuse.IN_READERS). Groups along
    the reduction: where C_in / group >= --weight-group, `group` input channels at one tap (axis 1, blocked, a
    last one shorter); else one scale per output channel over its whole reduction C_in / group * k.. (axis 0, per
    axis: a depthwise conv's k x k taps, a first conv's 3 x k x k), where a group along axis 1 would be one tap's
    few channels."""
    shape = static_shape(weight)
    w = np.asarray(weight.const_value.numpy(), np.float32)  # type: ignore[union-attr]
    dtype = STORED_AS[weights.weights]
    if shape[1] >= weights.group:
        axis, group = 1, weights.group
        q, scale = quantize(w, axis, group, dtype)
        attributes = {"axis": axis, "block_size": group}
        deq = dequantize(q, scale, None, axis, group)
    else:  # per output channel: W viewed [C_out, R], one group of the whole row
        axis, group = 0, int(np.prod(shape[1:]))
        q, scale = quantize(w.reshape(shape[0], -1), 1, group, dtype)
        q, scale = q.reshape(shape), scale.reshape(-1)
        attributes = {"axis": axis}
        deq = dequantize(q, scale, None, axis, 0)
    q_value = _initializer(graph, f"{weight.name}.q", ir.tensor(q, dtype=dtype), weight.name)
    scale_value = _initializer(graph, f"{weight.name}.scale", ir.tensor(scale), weight.name, "fp16")
    _replace(graph, weight, ir.node("DequantizeLinear", [q_value, scale_value], attributes,
                                    name=f"{weight.name}.dequantize", num_outputs=1))
    return {"weight": weight.name, "shape": list(shape), "format": weights.weights,
            "axis": axis, "group": group, "error": _relative_error_in_slices(w, deq)}


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol, weight: str, storage: str | None = None
                 ) -> ir.Value:
    """A frozen initializer standing for (part of) `weight`; a float one stored in `storage`, which
    storage_precision keeps."""
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    keys.set_role(value, Role.FROZEN)
    value.metadata_props[QUANTIZED] = weight
    if storage:
        value.metadata_props[keys.STORAGE] = storage
    graph.register_initializer(value)
    return value


def _replace(graph: ir.Graph, weight: ir.Value, node: ir.Node) -> None:
    """`node`'s output in every place that read `weight`, which leaves the graph."""
    first_reader = min((use.node for use in weight.uses()), key=list(graph).index)
    graph.insert_before(first_reader, node)
    out = node.outputs[0]
    out.shape, out.type = weight.shape, ir.TensorType(ir.DataType.FLOAT)
    out.metadata_props[QUANTIZED] = weight.name
    for use in list(weight.uses()):
        if use.node is not node:
            use.node.replace_input_with(use.idx, out)
    graph.initializers.pop(weight.name)


class _Error:
    """||W - approx||_F / ||W||_F summed a slice at a time (in float64; 0 for an all-zero W)."""

    def __init__(self) -> None:
        self.squared_norm = self.squared_error = 0.0

    def add(self, values: np.ndarray, approx: np.ndarray) -> None:
        values = np.asarray(values, np.float64)
        self.count(float(np.square(values).sum()), float(np.square(values - approx).sum()))

    def count(self, squared_norm: float, squared_error: float) -> None:
        self.squared_norm += squared_norm
        self.squared_error += squared_error

    @property
    def relative(self) -> float:
        return (self.squared_error / self.squared_norm) ** 0.5 if self.squared_norm else 0.0


def _quantize_in_slices(w: np.ndarray, axis: int, group: int, dtype: ir.DataType,
                        read: Callable[[], None] = lambda: None) -> tuple[np.ndarray, np.ndarray, float]:
    """quantize(w, axis, group, dtype) of a 2-D `w` and its relative error, a slice of rows at a time (whole groups
    where the groups run down the rows, axis 0): a 1B decoder's embedding table or LM head (128256 x 2048, 1 GB
    in float32) is quantized with temporaries of CACHED_ELEMENTS, not several float copies of the whole table
    (host memory), and contiguous slices that fit the CPU's cache. `read` is called after every SLICE_ELEMENTS
    or so (MappedConstant.drop: the pages read so far handed back; a page a later slice shares is read again)."""
    rows, cols = w.shape
    whole = group if axis == 0 else 1  # rows of a slice: a multiple of this
    step = max(whole, CACHED_ELEMENTS // max(1, cols) // whole * whole)
    q = np.empty(w.shape, INT_FORMATS[dtype].numpy)
    scale = np.empty((-(-rows // group), cols) if axis == 0 else (rows, -(-cols // group)), np.float32)
    error = _Error()
    unread = 0
    for start in range(0, rows, step):
        end = min(rows, start + step)
        scales = slice(start // group, -(-end // group)) if axis == 0 else slice(start, end)
        q[start:end], scale[scales], sums = quantize_with_error(w[start:end], axis, group, dtype)
        error.count(*sums)
        unread += (end - start) * cols
        if unread >= SLICE_ELEMENTS or end == rows:
            read()
            unread = 0
    return q, scale, error.relative


#: (q, scale, relative error) by the external data it was quantized from and how (file, offset, bytes, shape,
#: axis, group, format), while reused_quantization() is open; else None
_REUSED: dict[tuple, tuple[np.ndarray, np.ndarray, float]] | None = None


@contextlib.contextmanager
def reused_quantization() -> Iterator[None]:
    """Within it, a weight quantized again from the same external data the same way is the first result: a
    --device-memory retry (codegen.compile.build_program) builds the step again from the model as read, and its
    quantization was a third of a 1B LoRA int4 build's passes. The arrays are the first build's graph's (no copy);
    a retry's graph holds them again."""
    global _REUSED
    outer, _REUSED = _REUSED, {}
    try:
        yield
    finally:
        _REUSED = outer


def _quantized(source: ir.TensorProtocol, axis: int, weights: WeightFormat) -> tuple[np.ndarray, np.ndarray, float]:
    """_quantize_in_slices of the 2-D weight `source` (its pages handed back as read), or the result kept by
    reused_quantization."""
    dtype = STORED_AS[weights.weights]
    key = None
    if _REUSED is not None and isinstance(source, ir.ExternalTensor):
        key = (source.path, source.offset, source.length, tuple(source.shape), axis, weights.group, weights.weights)
        if key in _REUSED:
            return _REUSED[key]
    with MappedConstant(source) as mapped:  # pages handed back after each slice
        w = np.asarray(mapped.array, np.float32)
        found = _quantize_in_slices(w, axis, group_of(w.shape[axis], weights.group), dtype, mapped.drop)
        del w
    if key is not None:
        _REUSED[key] = found  # type: ignore[index]
    return found


def _relative_error_in_slices(w: np.ndarray, approx: np.ndarray) -> float:
    """relative_error(w, approx), SLICE_ELEMENTS at a time (its float64 copies bounded)."""
    rows = max(1, SLICE_ELEMENTS // max(1, w.shape[-1]))
    error = _Error()
    for start in range(0, w.shape[0], rows):
        error.add(w[start:start + rows], approx[start:start + rows])
    return error.relative


class QuantizeWeights(ContractPass):
    """Frozen contraction weights and Gather tables in --weights' storage (in place)."""

    name = "quantize_weights"
    requires_facts = ("trainable inputs",)

    def __init__(self, weights: WeightFormat) -> None:
        super().__init__()
        weights.validate()
        self.weights = weights

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.weights.weights == "fp32":
            return ir.passes.PassResult(model, False)
        graph = model.graph
        records = []
        for weight in list(graph.initializers.values()):
            conv = _conv_candidate(weight)
            if conv and self.weights.quantized:
                records.append(_quantize_conv(graph, weight, self.weights))
                continue
            axis = 1 if conv else _candidate(weight)  # a Conv weight in fp16: its reduction is every axis but 0
            if axis is None:
                continue
            if self.weights.weights == "fp16":  # fp16 values in a half texture, which the contraction reads
                source = weight.const_value
                assert source is not None
                error = _Error()
                with MappedConstant(source) as mapped:  # the rounding's error, a slice at a time
                    for piece in flat_pieces(mapped, SLICE_ELEMENTS * 4):
                        error.add(piece, np.asarray(piece, np.float32).astype(np.float16).astype(np.float32))
                weight.const_value = ir.LazyTensor(HalfRounded(source), ir.DataType.FLOAT, ir.Shape(source.shape),
                                                   name=weight.name)  # rounded where read: no copy held
                weight.metadata_props[QUANTIZED], weight.metadata_props[keys.STORAGE] = weight.name, "fp16"
                records.append({"weight": weight.name, "shape": list(source.shape), "format": "fp16",
                                "error": error.relative})
                continue
            q, scale, error = _quantized(weight.const_value, axis, self.weights)  # type: ignore[arg-type]
            dtype, group = STORED_AS[self.weights.weights], group_of(q.shape[axis], self.weights.group)
            weight.const_value = None  # the weight leaves the graph (_replace): its float values with it
            q_value = _initializer(graph, f"{weight.name}.q", ir.tensor(q, dtype=dtype), weight.name)
            scale_value = _initializer(graph, f"{weight.name}.scale", ir.tensor(scale), weight.name, "fp16")
            _replace(graph, weight, ir.node("DequantizeLinear", [q_value, scale_value],
                                            {"axis": axis, "block_size": group}, name=f"{weight.name}.dequantize",
                                            num_outputs=1))
            records.append({"weight": weight.name, "shape": list(q.shape), "format": self.weights.weights,
                            "axis": axis, "group": group, "error": error})
        if not records:
            return ir.passes.PassResult(model, False)
        if self.weights.quantized and model.opset_imports.get("", BLOCKED_OPSET) < BLOCKED_OPSET:
            model.opset_imports[""] = BLOCKED_OPSET
        model.metadata_props[QUANTIZED] = json.dumps(records)
        return ir.passes.PassResult(model, True)
