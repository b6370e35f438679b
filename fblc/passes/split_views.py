"""split_views: a Split whose every output can be a view becomes one Slice per output.

Rewrite: Y_0..Y_n = Split(X, axis) becomes Y_k = Slice(X, start_k, start_k + size_k, axis) for each
output, when tile_remap would map every one of those Slices as an offset view of X's root (its
readers add a view's offset, its texels stay whole: `tile_remap.remap_status`); the Split's
kernel, a copy of X, then disappears. A Split with any output that would stay a copy is left
alone: one Split kernel writes all its outputs in one launch, where separate Slices would take
one each. The autodiff writes a Split for the gradient of every Concat (rotary embeddings'
rotate_half, 8 in the Llama decoder of the tests).
Y_k keep their values (names, shapes, readers). Preconditions: static shapes; run right before
tile_remap (which maps the Slices), under the rtile layout. In place; `modified` when a Split
was rewritten.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, static_shape
from fblc.passes.contracts import ContractPass
from fblc.passes.tile_remap import remap_status


def _slices(graph: ir.Graph, split: ir.Node) -> list[ir.Node]:
    """One Slice per output of `split`, inserted before it, reading its input."""
    shape = static_shape(split.inputs[0])
    axis = int(attr(split, "axis", 0)) % len(shape)
    e = Emitter(graph, stage=split.metadata_props.get(keys.STAGE, "forward"))
    e.anchor, e.prefix = split, f"{split.name}/view"
    e.origin = split.metadata_props.get(keys.GRAD_OF)
    slices, start = [], 0
    for output in split.outputs:
        size = static_shape(output)[axis]
        value = e.op("Slice", split.inputs[0], e.ints([start]), e.ints([start + size]), e.ints([axis]))
        slices.append(value.producer())
        start += size
    return slices


def _viewed(graph: ir.Graph, split: ir.Node) -> bool:
    """Rewrite `split` into Slices when every one remaps; True when it did."""
    slices = _slices(graph, split)
    for output, piece in zip(split.outputs, slices):
        output.replace_all_uses_with(piece.outputs[0])
    if all(remap_status(piece)[0] == "remapped" for piece in slices):
        for output, piece in zip(split.outputs, slices):
            name = output.name
            output.name, piece.outputs[0].name = f"{name}/split", name
        graph.remove(split, safe=True)
        return True
    for output, piece in zip(split.outputs, slices):  # undo: the Split keeps its readers
        piece.outputs[0].replace_all_uses_with(output)
    bounds = {id(v): v for piece in slices for v in piece.inputs[1:] if v is not None}
    for piece in slices:
        graph.remove(piece, safe=True)
    for value in bounds.values():  # the Slices' start/end constants, unless another node shares them
        if not value.uses() and value.name in graph.initializers:
            del graph.initializers[value.name]
    return False


class SplitViews(ContractPass):
    """Turn Splits whose outputs can all be offset views into Slices (in place)."""

    name = "split_views"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        splits = [n for n in graph if n.op_type == "Split" and n.domain == ""
                  and not any(out.is_graph_output() for out in n.outputs)]
        modified = False
        for split in splits:
            modified |= _viewed(graph, split)
        return ir.passes.PassResult(model, modified)
