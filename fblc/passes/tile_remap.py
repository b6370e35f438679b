"""tile_remap: data-movement ops between stored tensors become index maps.

Rewrite: a Transpose, Reshape, Flatten, Squeeze, Unsqueeze, broadcast Expand or forward Slice gets
`fblc.index_map` (its output as a strided view of the root tensor it reads, composed through
earlier remapped views) and so runs no kernel: its consumers read the root's texture through
the map. It is remapped when
  1. tile dimension dependency: the output is a strided view of the root (a permutation maps
     whole axes to whole axes; a reshape merges only axes that are contiguous in the root);
  2. tile boundary preservation: every texel of the root (4 consecutive elements of its
     packed axis) stays a run along one axis of the view, so whole-texel reads remain valid;
  3. when the view is not a plain row-major reading of the root: every kernel that reads it
     takes strided operands (STRIDED_READERS), and where the view starts past the root's first
     element (a Slice), every one also adds that offset (OFFSET_READERS). A strided graph output (a weight gradient that
     the backward wrote transposed) is read by the local runtime through its map (plan.json
     `value_maps`); the native runner reads only parameters and the loss, never these.
A Transpose marked keys.WRITTEN_BY_PRODUCER stays one for its conv's kernel to write (fuse) where
`written_reduction` allows (pipeline.layout_passes: CPU targets). Otherwise the node stays an explicit
conversion kernel; `fblc.remap` on it says which check
failed. The backward of MatMul (dX = dY W^T, dW = X^T dY) thus reads W^T and X^T in place.
Under `--layout naive` (`remap=False`) every one stays a copy, `fblc.remap` saying so (NAIVE).
Preconditions: static shapes, topologically sorted graph. Ensures `index maps`: every
data-movement node is a view or a copy with its reason. In place; `modified` is true when any
annotation changed.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.index_map import (
    REMAPPABLE,
    IndexMap,
    common_digits,
    compose,
    is_view,
    map_of,
    real_readers,
    view_root,
    views_of,
)
from fblc.compiler.ops import Reads, reading
from fblc.compiler.values import numel, static_shape
from fblc.passes.contracts import ContractPass

#: the status of every data-movement node under --layout naive
NAIVE = "naive layout: every data-movement op is a copy"


#: Ops whose kernels read every input element through the builder's index composition or
#: through explicit strides (never by raw texel position), so they accept any strided view; the
#: ones that also add a view's offset (a Slice's start: every element through KernelBuilder.load;
#: the contractions and reductions read their operands by strides alone); the readers of a folded
#: view (its axes mixed-radix digits: KernelBuilder.load, the reductions where their input is not a
#: plain tensor, and MatMul, which walks a folded K axis as nested loops). The op table's `reads`
#: (fblc/compiler/ops.py) says which.
#: the `fblc.remap` a pass gives a data-movement node that must stay a copy: a packing of a tensor in the order
#: its reader wants (pointwise_transposes' transposed weights), which as a view would be read as strided as before
PACKED = "kept: a packing for its reader (a copy on purpose)"
STRIDED_READERS = reading(Reads.STRIDED)
OFFSET_READERS = reading(Reads.STRIDED | Reads.OFFSET)
FOLDED_READERS = reading(Reads.FOLDED)


def _reader_maps(value: ir.Value, index_map: IndexMap) -> Iterator[tuple[ir.Node, int, IndexMap | None]]:
    """(reader, input slot, the map it reads `value` through) for every reader, composing through the
    movement nodes after `value` as if they became views (None past one that could not)."""
    for use in value.uses():
        node = use.node
        if _moves_data(node) and node.outputs:
            composed = compose(node, index_map) if node.op_type in REMAPPABLE else index_map
            if composed is not None:
                yield from _reader_maps(node.outputs[0], composed)
                continue
        yield node, use.idx, None if _moves_data(node) else index_map


def _folded_refusal(output: ir.Value, mapped: IndexMap) -> str | None:
    """Why the folded view `output` must stay a copy, or None when every reader can read it."""
    graph_outputs = {id(v) for v in output.graph.outputs} if output.graph is not None else set()
    if any(id(v) in graph_outputs for v in [output, *views_of(output)]):
        return "a folded view is a step output, which the runtimes read as a plain tensor"
    for reader, slot, seen in _reader_maps(output, mapped):
        if seen is None:  # a movement kernel: it reads every element through its map
            continue
        if reader.op_type not in FOLDED_READERS:
            return f"read by {reader.op_type}, whose kernel cannot read folded axes"
        if reader.op_type == "MatMul" and not matmul_reads_folded(reader, slot, seen):
            return "a MatMul's K axis folds differently in its two operands"
    return None


def matmul_reads_folded(node: ir.Node, slot: int, seen: IndexMap) -> bool:
    """Whether `node`'s contraction can walk its operand `slot` read through `seen`: a matrix
    operand, whose K axis digits and the other operand's nest (codegen.kernels.contraction)."""
    other = node.inputs[1 - slot]
    if len(seen.shape) < 2 or other is None or len(static_shape(other)) < 2:
        return False
    a_map, w_map = (seen, map_of(other)) if slot == 0 else (map_of(other), seen)
    return common_digits([a_map.sub_axes(len(a_map.shape) - 1), w_map.sub_axes(len(w_map.shape) - 2)]) is not None


def _moves_data(node: ir.Node) -> bool:
    """A view or data movement that may become one: its readers are the ones a remap must satisfy."""
    return is_view(node) or node.op_type in REMAPPABLE


def remap_status(node: ir.Node) -> tuple[str, str | None]:
    """('remapped', map JSON) or (the failed check, None)."""
    source = node.inputs[0]
    output = node.outputs[0]
    if source is None:
        return "kept: no input", None
    mapped = compose(node, map_of(source))
    if mapped is None:
        return "kept: tile dimension dependency fails (axes merged that are not contiguous in the root)", None
    root_shape = static_shape(view_root(source))
    if not mapped.packs_whole_texels(root_shape):
        return "kept: tile boundary preservation fails (a texel of the root would span view rows)", None
    if mapped.folded:
        refused = _folded_refusal(output, mapped)
        if refused:
            return f"kept: {refused}", None
    if not mapped.contiguous:
        readers = {n.op_type for n in real_readers(output, through=_moves_data)}
        blocked = sorted(readers - STRIDED_READERS)
        if blocked:
            return f"kept: read by {', '.join(blocked)}, whose kernels need a plain tensor", None
        blocked = sorted(readers - OFFSET_READERS) if mapped.offset else []
        if blocked:
            return f"kept: read by {', '.join(blocked)}, whose kernels read strides but no offset", None
    return "remapped", mapped.to_json()


class TileRemap(ContractPass):
    """Turn data-movement nodes into index maps where the checks allow (in place)."""

    name = "tile_remap"
    requires_facts = ("static shapes",)
    ensures_facts = ("index maps",)

    def __init__(self, remap: bool = True, written_reduction: int = 0) -> None:
        """`remap` False (--layout naive): every data-movement node stays a copy, labelled so.
        `written_reduction`: a Transpose marked keys.WRITTEN_BY_PRODUCER (a conv weight gradient in W's own
        order) whose conv reduces at most this many products per output stays so, for that conv's kernel to
        write; otherwise it is remapped like any other (0, a GPU target: pipeline.layout_passes)."""
        super().__init__()
        self.remap = remap
        self.written_reduction = written_reduction

    def written_in_place(self, node: ir.Node) -> bool:
        """Whether `node` stays a Transpose that the kernel of its input writes (see __init__)."""
        if node.metadata_props.get(keys.REMAP) != keys.WRITTEN_BY_PRODUCER:
            return False
        producer = node.inputs[0].producer() if node.inputs[0] is not None else None
        kernels = producer.inputs[1] if producer is not None and len(producer.inputs) > 1 else None
        return kernels is not None and numel(static_shape(kernels)[1:]) <= self.written_reduction

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in graph:
            if node.op_type not in REMAPPABLE or node.domain != "" or node.metadata_props.get(keys.REMAP) == PACKED \
                    or self.written_in_place(node):
                continue
            status, mapped = remap_status(node) if self.remap else (NAIVE, None)
            if node.metadata_props.get(keys.REMAP) != status:
                node.metadata_props[keys.REMAP] = status
                modified = True
            if mapped is not None and node.metadata_props.get(keys.INDEX_MAP) != mapped:
                node.metadata_props[keys.INDEX_MAP] = mapped
                modified = True
        return ir.passes.PassResult(model, modified)
