"""batch_tile: run the high-resolution front of a CNN in batch chunks, so its transient
working set shrinks while the step computes exactly the same thing.

MemFLoRA's device peak is set by the temporaries of the largest early layers, not by saved
state (the paper's figure 4: 82.7 of 95.4 MB). Every op of a CNN's front is per sample, so
the front can run on B/k samples at a time: the k chunks are written one after the other,
their outputs joined by a Concat, and autodiff then writes the backward chunk by chunk too.
Saved state is unchanged (the chunks' masks and q add up to the full batch's); gradients of
shared weights are summed over the chunks, which is what one full-batch pass sums.

Rewrite (forward graph, before mark_trainable): find the largest activation; if it exceeds
`tile_bytes`, take the front: the nodes up to the first point after the last activation
larger than `tile_bytes` where a single activation v, itself at most `tile_bytes`, carries
everything onward. When every
node of the front is per sample (Conv, pooling, elementwise ops whose other operands are
constants without a batch axis, eval BatchNormalization, Pad off the batch axis), the front is
replaced by k copies, each reading `Slice(input, chunk)` of the batch inputs, with k the
smallest power of two dividing B that brings the largest activation under `tile_bytes`;
v's consumers read `Concat(v_0 ... v_k-1)`. Value metadata (adapter sites) is copied onto
the chunks. Preconditions: static shapes; topologically sorted; no loss yet. In place;
`modified` false when the largest activation fits, the batch cannot be split, or the front
has an op that mixes samples.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys, ops
from fblc.compiler.graph import Emitter, attr, const_array, static_shape
from fblc.compiler.values import numel
from fblc.passes.contracts import ContractPass

#: ops that never mix samples (the op table's `per_sample`, fblc/compiler/ops.py)
PER_SAMPLE = ops.ops_where(lambda entry: entry.per_sample)


def _bytes(value: ir.Value) -> int:
    return int(numel(static_shape(value)) * ir.DataType(value.dtype).itemsize)


def _is_constant(value: ir.Value) -> bool:
    return value.const_value is not None or const_array(value) is not None


class BatchTile(ContractPass):
    """Split the front of the network into batch chunks (in place)."""

    name = "batch_tile"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def __init__(self, tile_bytes: int) -> None:
        super().__init__()
        self.tile_bytes = tile_bytes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        if self.tile_bytes <= 0:
            return ir.passes.PassResult(model, False)
        batch_inputs = [v for v in graph.inputs if v.const_value is None and v.shape is not None and len(v.shape) > 0]
        if not batch_inputs:
            return ir.passes.PassResult(model, False)
        batch = static_shape(batch_inputs[0])[0]
        nodes = list(graph)
        position = {id(n): i for i, n in enumerate(nodes)}
        activations = [v for n in nodes for v in n.outputs if v is not None and v.shape is not None and not _is_constant(v)]
        big = [v for v in activations if _bytes(v) > self.tile_bytes]
        if not big or batch < 2:
            return ir.passes.PassResult(model, False)
        largest = max(_bytes(v) for v in big)
        chunks = 1
        while largest / chunks > self.tile_bytes and batch % (chunks * 2) == 0:
            chunks *= 2
        if chunks == 1:
            return ir.passes.PassResult(model, False)
        last_big = max(position[id(v.producer())] for v in big)
        cut = self._cut(graph, nodes, position, last_big, batch, self.tile_bytes)
        if cut is None:
            return ir.passes.PassResult(model, False)
        front_end, carried = cut
        front = nodes[: front_end + 1]
        if not all(self._per_sample(n, batch) for n in front):
            return ir.passes.PassResult(model, False)
        self._rewrite(graph, front, carried, batch_inputs, batch, chunks)
        model.metadata_props[keys.BATCH_TILE] = json.dumps({"chunks": chunks, "front_nodes": len(front),
                                                            "cut": carried.name, "largest_bytes": largest,
                                                            "tile_bytes": self.tile_bytes})
        return ir.passes.PassResult(model, True)

    @staticmethod
    def _cut(graph: ir.Graph, nodes: list[ir.Node], position: dict[int, int], after: int, batch: int,
             limit: int) -> tuple[int, ir.Value] | None:
        """(index of the front's last node, the one activation that crosses) at the first cut after `after`
        where that activation is at most `limit` bytes."""
        last_use: dict[int, int] = {}
        defined: dict[int, int] = {}
        values: dict[int, ir.Value] = {}
        outputs = {id(v) for v in graph.outputs}
        for value in graph.inputs:
            if value.const_value is None:
                defined[id(value)] = -1
                values[id(value)] = value
        for i, node in enumerate(nodes):
            for value in node.inputs:
                if value is not None and id(value) in defined:
                    last_use[id(value)] = i
            for value in node.outputs:
                if value is not None and not _is_constant(value):
                    defined[id(value)] = i
                    values[id(value)] = value
        end = len(nodes)
        for key in outputs:
            last_use[key] = end
        ending: dict[int, list[int]] = {}
        starting: dict[int, list[int]] = {}
        for key, d in defined.items():
            if last_use.get(key, d) > d:
                starting.setdefault(max(d, -1), []).append(key)
                ending.setdefault(last_use[key], []).append(key)
        crossing: set[int] = set(starting.get(-1, []))
        for c in range(len(nodes) - 1):  # after node c: the values made up to c and read after it
            crossing.update(starting.get(c, []))
            crossing.difference_update(ending.get(c, []))
            if c < after or len(crossing) != 1:
                continue
            value = values[next(iter(crossing))]
            if (value.producer() is not None and value.shape is not None and static_shape(value)[0] == batch
                    and _bytes(value) <= limit):
                return c, value
        return None

    @staticmethod
    def _per_sample(node: ir.Node, batch: int) -> bool:
        if node.domain != "" or node.op_type not in PER_SAMPLE:
            return False
        if node.op_type == "BatchNormalization" and int(attr(node, "training_mode", 0)):
            return False
        if node.op_type == "Pad":
            pads = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
            if pads is None or len(node.inputs) > 3 and node.inputs[3] is not None:
                return False
            pads = np.asarray(pads).reshape(-1)
            if pads[0] != 0 or pads[len(pads) // 2] != 0:
                return False
        for value in node.outputs:
            if value is None or value.shape is None or len(value.shape) == 0 or static_shape(value)[0] != batch:
                return False
        for index, value in enumerate(node.inputs):
            if value is None:
                continue
            if _is_constant(value):
                shape = static_shape(value)
                rank = len(static_shape(node.outputs[0]))
                if node.op_type not in ("Conv", "BatchNormalization", "Pad", "Clip") and len(shape) == rank and shape[0] != 1:
                    return False  # a constant with its own batch axis
                continue
            if value.shape is None or len(value.shape) == 0 or static_shape(value)[0] != batch:
                return False
        return True

    @staticmethod
    def _rewrite(graph: ir.Graph, front: list[ir.Node], carried: ir.Value, batch_inputs: list[ir.Value], batch: int,
                 chunks: int) -> None:
        size = batch // chunks
        anchor = front[0]
        e = Emitter(graph, stage="batch_tile")  # its own stage: constant names stay unique; nodes are re-tagged below
        e.anchor = anchor
        front_ids = {id(n) for n in front}
        read_inputs = [v for v in batch_inputs if any(id(u.node) in front_ids for u in v.uses())]
        pieces: list[ir.Value] = []
        for chunk in range(chunks):
            mapping: dict[int, ir.Value] = {}
            for value in read_inputs:
                piece = e.op("Slice", value, e.ints([chunk * size]), e.ints([(chunk + 1) * size]), e.ints([0]))
                piece.name = f"{value.name}/chunk{chunk}"
                mapping[id(value)] = piece
            for node in front:
                inputs = [None if v is None else mapping.get(id(v), v) for v in node.inputs]
                outputs = []
                for value in node.outputs:
                    shape = None if value.shape is None else ir.Shape([size] + list(static_shape(value))[1:])
                    clone = ir.Value(name=f"{value.name}/chunk{chunk}" if value.name else None, shape=shape,
                                     type=value.type)
                    for key, text in value.metadata_props.items():
                        clone.metadata_props[key] = text
                    outputs.append(clone)
                copy = ir.Node(node.domain, node.op_type, inputs, list(node.attributes.values()), outputs=outputs,
                               name=f"{node.name}/chunk{chunk}")
                for key, text in node.metadata_props.items():
                    copy.metadata_props[key] = text
                graph.insert_before(anchor, copy)
                for old, new in zip(node.outputs, outputs):
                    mapping[id(old)] = new
            pieces.append(mapping[id(carried)])
        joined = e.op("Concat", *pieces, axis=0)
        for node in graph:
            if node.metadata_props.get(keys.STAGE) == "batch_tile":
                node.metadata_props[keys.STAGE] = "forward"
        name = carried.name
        carried.replace_all_uses_with(joined, replace_graph_outputs=True)
        carried.name, joined.name = f"{name}/whole", name
        for node in reversed(front):
            for value in node.outputs:
                for use in list(value.uses()):
                    assert id(use.node) in front_ids, f"{value.name} is read after the cut by {use.node.name}"
            graph.remove(node, safe=True)
