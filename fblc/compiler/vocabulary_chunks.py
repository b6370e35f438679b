"""A quantized vocabulary table cut into chunks at compile time, and an embedding Gather that reads the chunks.

passes/chunk_loss reads an LM head that is stored quantized (DequantizeLinear of initializers, blocks along the
hidden axis) one vocabulary chunk at a time: each chunk is a DequantizeLinear of its own slice of the integers and
scales (zero points), made once, which its readers dequantize in their loads (fuse.DEQUANTIZING_READS). Where the
head is tied to the embedding (Llama-3.2-1B: one [V, D] table read by the embedding Gather and, transposed, by the
head), the Gather is rewritten to read the same chunks, so the whole table leaves the graph and nothing is stored
twice: a Slice at an offset is no view a contraction reads, and a second, whole copy of the table for the Gather
alone would cost as much as the head (148 MB at int4 for Llama-3.2-1B).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, static_shape


def dequantized_chunk(node: ir.Node, axis: int, start: int, size: int, anchor: ir.Node,
                      made: dict[int, ir.Value]) -> ir.Value:
    """Rows (axis 0) or columns (axis 1) [start, start + size) of DequantizeLinear `node`'s 2-D output: a
    DequantizeLinear (no stage: it runs in its readers' loads) of new initializers holding that slice of the
    integers and of the scales (zero points) that run along `axis`, inserted before `anchor`; made once per chunk
    (`made`: start -> chunk)."""
    if start in made:
        return made[start]
    assert node.graph is not None
    graph = node.graph
    along = int(node.attributes.get_int("axis", 1)) % 2  # a 1-D scale runs along this axis of the data
    inputs: list[ir.Value | None] = []
    for value in node.inputs:
        array = None if value is None else np.asarray(value.const_value.numpy())  # type: ignore[union-attr]
        cut = axis if array is not None and array.ndim == 2 else 0 if array is not None and array.ndim == 1 \
            and along == axis else None
        if value is None or array is None or cut is None:  # per tensor, or a scale across the vocabulary: shared
            inputs.append(value)
            continue
        part = np.ascontiguousarray(array[(slice(None),) * cut + (slice(start, start + size),)])
        tensor = ir.tensor(part, dtype=value.dtype, name=f"{value.name}/{start}")
        sliced = ir.Value(name=tensor.name, shape=ir.Shape(part.shape), type=ir.TensorType(value.dtype),
                          const_value=tensor)
        sliced.metadata_props.update(value.metadata_props)  # role frozen, fblc.quantized, fp16 storage
        graph.register_initializer(sliced)
        inputs.append(sliced)
    chunk = ir.node("DequantizeLinear", inputs, {a.name: a for a in node.attributes.values()},
                    name=f"{node.name}/{start}", num_outputs=1)
    graph.insert_before(anchor, chunk)
    out = chunk.outputs[0]
    shape = list(static_shape(node.outputs[0]))
    shape[axis] = size
    out.name, out.shape, out.type = f"{node.outputs[0].name}/{start}", ir.Shape(shape), node.outputs[0].type
    out.metadata_props.update(node.outputs[0].metadata_props)
    made[start] = out
    return out


def embedding_gather(node: ir.Node) -> bool:
    """Whether `node` is a Gather that reads its table's rows (axis 0) by int64 ids: an embedding lookup."""
    return node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node.inputs[1] is not None and \
        node.inputs[1].dtype == ir.DataType.INT64 and int(node.attributes.get_int("axis", 0)) == 0


def gather_from_chunks(gather: ir.Node, chunks: list[tuple[int, ir.Value]], rows: int) -> None:
    """Readers of embedding Gather `gather` (table [rows, D]) read the same rows gathered from the row chunks
    (start, [size, D] table chunk) instead: sum over chunks of Where(id in chunk, Gather(chunk, id - start), 0).
    Each row comes from the one chunk that holds it and the others add exact zeros, so the values are the
    Gather's. Ids wrap as ONNX's do (a negative id counts from the end); the Gather is removed."""
    e = Emitter(gather.graph, stage=gather.metadata_props.get(keys.STAGE, "forward"))  # type: ignore[arg-type]
    e.anchor, e.prefix = gather, gather.name or "embedding"
    ids = gather.inputs[1]
    assert ids is not None
    zero = e.const(np.array(0, np.int64))
    ids = e.op("Where", e.op("Less", ids, zero), e.op("Add", ids, e.const(np.array(rows, np.int64))), ids)
    nothing = e.scalar(0.0, chunks[0][1])
    total: ir.Value | None = None
    for start, table in chunks:
        size = static_shape(table)[0]
        local = e.op("Sub", ids, e.const(np.array(start, np.int64)))
        end = e.const(np.array(size, np.int64))
        inside = e.op("And", e.op("GreaterOrEqual", local, zero), e.op("Less", local, end))
        picked = e.op("Gather", table, e.op("Where", inside, local, zero), axis=0)
        part = e.op("Where", e.op("Unsqueeze", inside, e.ints([-1])), picked, nothing)
        total = part if total is None else e.op("Add", part, total)
    assert total is not None
    old = gather.outputs[0]
    total.shape, total.type = old.shape, old.type
    total.metadata_props.update(old.metadata_props)
    ir.convenience.replace_all_uses_with(old, total, replace_graph_outputs=True)
    gather.graph.remove(gather, safe=True)  # type: ignore[union-attr]
