"""The LM head and the loss that pass chunk_loss cuts into vocabulary chunks, found as the gradient pass left
them: the MatMul(s) whose sum is the logits (x W, an nn.Linear's W^T, LoRA's x W + (x A) B), a quantized head's
DequantizeLinear and whether it can be cut at compile time (tied embedding Gathers included), the loss nodes,
and the backward nodes their gradient rules wrote (_find_head, _backward_of); a head that does not match says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import static_shape
from fblc.compiler.vocabulary_chunks import embedding_gather
from fblc.passes.attach_loss import LABELS, LOSS

@dataclass
class _Term:
    """One product x W of the logits (a LoRA head adds (x A) B to the model's own x W)."""

    matmul: ir.Node
    x: ir.Value  # [..., K]
    w: ir.Value  # [K, V]
    #: the [V, K] weight that `w` transposes (torch's nn.Linear exports W^T), read by the head alone; else None
    rows: ir.Value | None
    #: the DequantizeLinear of initializers that makes the stored weight (rows or w) where it is quantized: each
    #: chunk dequantizes its own slice of the integers and scales, cut at compile time (_dequantized_chunk)
    dequantize: ir.Node | None = None
    #: chunk start -> that chunk's stored weight (quantized heads: made once, read by the forward and the backward)
    chunks: dict[int, ir.Value] = field(default_factory=dict)
    #: a tied head's embedding Gathers of the whole quantized table, which come to read the chunks instead
    gathers: list[ir.Node] = field(default_factory=list)

    @property
    def nodes(self) -> list[ir.Node]:
        return [self.matmul] + ([self.w.producer()] if self.rows is not None else [])

    @property
    def vocabulary_axis(self) -> int:
        """The axis of the stored weight (rows [V, K] or w [K, V]) that the chunks cut."""
        return 0 if self.rows is not None else 1


@dataclass
class _Head:
    """The LM head and its loss as the gradient pass left them."""

    terms: list[_Term]
    adds: list[ir.Node]  # the Adds that sum the terms
    loss_nodes: list[ir.Node]  # forward nodes of stage `loss` between the logits and the loss Identity
    identity: ir.Node  # `loss` = Identity(...)
    labels: ir.Value


def _only_reader(value: ir.Value, node: ir.Node) -> bool:
    """Whether `node` is the one forward reader of `value` (the backward may read it too)."""
    return not value.is_graph_output() and all(
        r is node or r.metadata_props.get(keys.STAGE) == "backward" for r, _ in value.uses())


def _terms(value: ir.Value, adds: list[ir.Node]) -> list[_Term] | str:
    """The MatMuls whose sum (through Adds read by nothing else) is `value`, or why it is not one."""
    node = value.producer()
    if node is not None and node.op_type == "Add" and node.domain == "" and \
            static_shape(node.inputs[0]) == static_shape(node.inputs[1]) == static_shape(value):
        adds.append(node)
        found: list[_Term] = []
        for part in node.inputs:
            if part is None or not _only_reader(part, node):
                return "a summand of the logits is read elsewhere"
            terms = _terms(part, adds)
            if isinstance(terms, str):
                return terms
            found += terms
        return found
    if node is None or node.op_type != "MatMul" or node.domain != "":
        return "the logits are not a MatMul's output (or a sum of MatMuls')"
    x, w = node.inputs[0], node.inputs[1]
    if x is None or w is None or len(static_shape(w)) != 2 or len(static_shape(x)) < 2:
        return f"the weight of the LM head's MatMul '{node.name}' is not 2-D [D, V]"
    if not node.name:
        return "the LM head's MatMul has no name (its backward is found by the name it is the gradient of)"
    transpose = w.producer()
    rows = None
    if transpose is not None and transpose.op_type == "Transpose" and \
            list(transpose.attributes.get_ints("perm", [])) == [1, 0] and _only_reader(w, node):
        rows = transpose.inputs[0]
    term = _Term(node, x, w, rows)
    stored = (rows if rows is not None else w).producer()
    if stored is not None and stored.op_type == "DequantizeLinear":
        reader = transpose if rows is not None else node
        refused = _unsliceable(stored, term.vocabulary_axis, reader)
        if refused:
            return f"the LM head's weight is quantized (DequantizeLinear '{stored.name}') and {refused}"
        term.dequantize = stored
        term.gathers = [use.node for use in _forward_readers(stored.outputs[0], reader)]
    return [term]


def _forward_readers(value: ir.Value, head: ir.Node) -> list[ir.Usage]:
    """The forward's reads of `value` other than the head's `head` (the backward's go with the chunks)."""
    return [use for use in value.uses() if use.node is not head and use.node.metadata_props.get(keys.STAGE) != "backward"]


def _unsliceable(node: ir.Node, axis: int, reader: ir.Node) -> str:
    """Why the quantized head `node` cannot be cut into vocabulary chunks along its data's `axis` at compile
    time ("" where it can): its integers, scales (and zero points) must be initializers, its output read by the
    head's `reader` alone (and the backward, which the chunks replace) or by embedding Gathers of its rows (a tied
    head: they read the chunks too; else the whole float weight stays: a Slice at an offset is no view a
    contraction reads), and its blocks must not run along the vocabulary."""
    if any(v is not None and v.const_value is None for v in node.inputs):
        return "its integers or scales are not initializers"
    out = node.outputs[0]
    if out.is_graph_output() or any(use.idx != 0 or not embedding_gather(use.node) or axis != 0
                                    for use in _forward_readers(out, reader)):
        return "its float weight has readers other than the head and embedding Gathers of its rows"
    if len(static_shape(node.inputs[1])) > 1 and int(node.attributes.get_int("axis", 1)) % 2 == axis:
        return "its blocks run along the vocabulary"
    return ""


def _find_head(graph: ir.Graph) -> _Head | str:
    """The MatMuls whose logits the loss alone reads, or why there are none."""
    loss = graph.outputs[0]
    identity = loss.producer()
    if loss.name != LOSS or identity is None or identity.op_type != "Identity":
        return "the step's first output is not attach_loss's `loss`"
    labels = next((v for v in graph.inputs if v.name == LABELS), None)
    if labels is None:
        return "the loss takes no labels"
    logits = next((o for n in graph for o in n.outputs if o is not None and o.metadata_props.get(keys.PREDICTION)),
                  None)
    if logits is None:
        return "no value is marked as the model's prediction"
    loss_nodes = [n for n in graph if n.metadata_props.get(keys.STAGE) == "loss" and n is not identity]
    loss_ids = {id(n) for n in loss_nodes}
    if any(id(reader) not in loss_ids for reader, _ in logits.uses()) or logits.is_graph_output():
        return f"the logits '{logits.name}' are read by more than the loss"
    adds: list[ir.Node] = []
    terms = _terms(logits, adds)
    if isinstance(terms, str):
        return terms
    names = [n.name for n in [*adds, *(n for t in terms for n in t.nodes)]]
    if len(set(names)) < len(names) or any(sum(1 for n in graph if n.name == name) > 1 for name in names):
        return "the LM head's nodes have no names of their own (their backward is found by the names)"
    return _Head(terms, adds, loss_nodes, identity, labels)


def _backward_of(graph: ir.Graph, forward: list[ir.Node]) -> list[ir.Node]:
    """The backward nodes the gradient rules of `forward` wrote, with the Sums that join only their values."""
    origins = {n.name for n in forward}
    owned = [n for n in graph if n.metadata_props.get(keys.STAGE) == "backward"
             and n.metadata_props.get(keys.GRAD_OF) in origins]
    made = {id(o) for n in owned for o in n.outputs}
    # a Sum of contributions carries no origin: it is ours where all it joins is ours (graph order: a Sum is
    # met after the values it joins)
    for node in graph:
        if node.op_type == "Sum" and node.metadata_props.get(keys.STAGE) == "backward" and \
                keys.GRAD_OF not in node.metadata_props and all(id(v) in made for v in node.inputs):
            owned.append(node)
            made.update(id(o) for o in node.outputs)
    position = {id(n): i for i, n in enumerate(graph)}
    return sorted(owned, key=lambda n: position[id(n)])
