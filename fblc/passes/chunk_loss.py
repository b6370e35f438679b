"""chunk_loss: the cross-entropy over a large vocabulary in column chunks, so [T, V] logits never exist whole.

A language model's loss reads logits z = X W (W [D, V], V the vocabulary: 128256 for Llama 3) through
LogSoftmax; the backward saves log-probabilities [T, V] and makes dz [T, V]. Where V is large this pass
replaces the LM-head MatMul, the loss and their backward by chunks of C columns (the last one shorter
where C does not divide V):
- forward: per chunk z_c = X W[:, c], an online log-sum-exp (running row max m and sum s, rescaled by
  exp(m_old - m_new) when the max grows) and the label's logit picked in the chunk that holds it;
  what stays for the backward is lse = m + log s, one value per row;
- backward: per chunk z_c again (recomputed: one more MatMul per chunk), dz_c = (exp(z_c - lse) -
  onehot_c) * w / count * seed, consumed at once by dW_c = X^T dz_c and dX += dz_c W[:, c]^T.
So the largest loss temporary is [T, C] instead of [T, V]; dW is the chunks' columns concatenated.

Rewrite: the loss Identity reads the chunked loss; the backward nodes that the gradient pass wrote for
the MatMul and the loss go, their exits (dX, dW, by shape) read the chunked gradients instead.
Options: `chunk` (TrainingOptions.loss_chunk): columns per chunk, 0 off, -1 auto (AUTO_CHUNK columns
where V >= AUTO_FROM). Only the cross-entropy over a MatMul's logits that nothing else reads is chunked;
any other loss or shape leaves the graph unchanged (`modified` false, the reason in `self.skipped`).
Preconditions: the gradient pass ran (backprop; seed 1 or the state `loss_scale`). In place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, static_shape
from fblc.compiler.keys import Role
from fblc.compiler.loss_scale import SCALE
from fblc.compiler.losses import IGNORE_INDEX
from fblc.passes.attach_loss import LABELS, LOSS
from fblc.passes.contracts import ContractPass

AUTO_CHUNK = 8192  # columns: [256, 8192] fp32 is 8 MiB, one Llama-3 logits row block 1/16 of the whole
AUTO_FROM = 16384  # vocabularies from here on are chunked by default (BERT's 30522 and GPT-2's 50257 are)


def chunk_columns(chunk: int, vocabulary: int) -> int:
    """Columns per chunk for option `chunk` (0 off, -1 auto) over `vocabulary` classes; 0: not chunked."""
    if chunk < 0:
        return AUTO_CHUNK if vocabulary >= AUTO_FROM else 0
    return chunk if 0 < chunk < vocabulary else 0


@dataclass
class _Head:
    """The LM head and its loss as the gradient pass left them."""

    matmul: ir.Node
    x: ir.Value  # [..., D]
    w: ir.Value  # [D, V]
    loss_nodes: list[ir.Node]  # forward nodes of stage `loss` between the logits and the loss Identity
    identity: ir.Node  # `loss` = Identity(...)
    labels: ir.Value


def _find_head(graph: ir.Graph) -> _Head | str:
    """The MatMul whose logits the loss alone reads, or why there is none."""
    loss = graph.outputs[0]
    identity = loss.producer()
    if loss.name != LOSS or identity is None or identity.op_type != "Identity":
        return "the step's first output is not attach_loss's `loss`"
    labels = next((v for v in graph.inputs if v.name == LABELS), None)
    if labels is None:
        return "the loss takes no labels"
    logits = next((o for n in graph for o in n.outputs if o is not None and o.metadata_props.get(keys.PREDICTION)), None)
    matmul = None if logits is None else logits.producer()
    if matmul is None or matmul.op_type != "MatMul" or matmul.domain != "":
        return "the logits are not a MatMul's output"
    x, w = matmul.inputs[0], matmul.inputs[1]
    if x is None or w is None or len(static_shape(w)) != 2 or len(static_shape(x)) < 2:
        return "the LM head's weight is not 2-D [D, V]"
    if not matmul.name or sum(1 for n in graph if n.name == matmul.name) > 1:
        return "the LM head's MatMul has no name of its own (its backward is found by the name it is the gradient of)"
    loss_nodes = [n for n in graph if n.metadata_props.get(keys.STAGE) == "loss" and n is not identity]
    loss_ids = {id(n) for n in loss_nodes}
    if any(id(reader) not in loss_ids for reader, _ in logits.uses()) or logits.is_graph_output():
        return f"the logits '{logits.name}' are read by more than the loss"
    return _Head(matmul, x, w, loss_nodes, identity, labels)


def _backward_of(graph: ir.Graph, forward: list[ir.Node]) -> list[ir.Node]:
    """The backward nodes the gradient rules of `forward` wrote, with the Sums that join only their values."""
    origins = {n.name for n in forward}
    owned = [n for n in graph if n.metadata_props.get(keys.STAGE) == "backward"
             and n.metadata_props.get(keys.GRAD_OF) in origins]
    made = {id(o) for n in owned for o in n.outputs}
    for node in graph:  # graph order: a Sum is met after the values it joins  # a Sum of contributions carries no origin: it is ours where all it joins is ours
        if node.op_type == "Sum" and node.metadata_props.get(keys.STAGE) == "backward" and \
                keys.GRAD_OF not in node.metadata_props and all(id(v) in made for v in node.inputs):
            owned.append(node)
            made.update(id(o) for o in node.outputs)
    position = {id(n): i for i, n in enumerate(graph)}
    return sorted(owned, key=lambda n: position[id(n)])


class ChunkLoss(ContractPass):
    """Cross-entropy over vocabulary chunks, forward and backward (in place)."""

    name = "chunk_loss"
    requires_facts = ("static shapes", "loss", "gradients")
    ensures_facts = ("static shapes", "loss", "gradients")

    def __init__(self, chunk: int = -1, loss: str = "cross_entropy") -> None:
        super().__init__()
        self.chunk, self.loss = chunk, loss
        self.skipped = ""  # why the last model was left as it was ("" when chunked or not asked)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.skipped = ""
        if self.chunk == 0:
            return ir.passes.PassResult(model, False)
        if self.loss != "cross_entropy":
            self.skipped = f"--loss {self.loss}: only cross_entropy is chunked"
            return ir.passes.PassResult(model, False)
        head = _find_head(graph)
        if isinstance(head, str):
            self.skipped = head
            return ir.passes.PassResult(model, False)
        dim, vocabulary = static_shape(head.w)
        columns = chunk_columns(self.chunk, vocabulary)
        if columns == 0:
            self.skipped = f"vocabulary {vocabulary} below the chunk"
            return ir.passes.PassResult(model, False)
        backward = _backward_of(graph, [head.matmul, head.identity, *head.loss_nodes])
        owned = {id(n) for n in backward}
        exits = [o for n in backward for o in n.outputs
                 if o is not None and (o.is_graph_output() or any(id(r) not in owned for r, _ in o.uses()))]
        x_shape, w_shape = static_shape(head.x), static_shape(head.w)
        if x_shape == w_shape or any(static_shape(v) not in (x_shape, w_shape) for v in exits):
            self.skipped = "the head's backward has exits other than dX and dW"
            return ir.passes.PassResult(model, False)
        rows = math.prod(x_shape[:-1])
        forward = Emitter(graph, stage="loss")
        forward.anchor = head.identity
        stats = _chunked_forward(forward, head, rows, dim, vocabulary, columns)
        head.identity.replace_input_with(0, stats.loss)
        grad = Emitter(graph, stage="backward")
        grad.anchor = backward[0] if backward else None
        seed = next((v for v in graph.inputs if v.name == SCALE), None) or grad.scalar(1.0, stats.loss)
        dx, dw = _chunked_backward(grad, head, stats, seed, rows, vocabulary, columns,
                                   want_x=any(static_shape(v) == x_shape for v in exits),
                                   want_w=any(static_shape(v) == w_shape for v in exits))
        for value in exits:
            _take_place(value, dx if static_shape(value) == x_shape else dw)
        graph.remove(backward, safe=True)
        _drop_unused(graph, [head.matmul, *head.loss_nodes])
        for value in (head.x, head.w, stats.lse, stats.weights, stats.count, stats.labels):
            if keys.get_role(value) is None:
                keys.set_role(value, Role.SAVED)
        return ir.passes.PassResult(model, True)


@dataclass
class _Stats:
    loss: ir.Value
    lse: ir.Value  # [N, 1] log-sum-exp of each row's logits
    weights: ir.Value  # [N] 1 where the label counts, else 0
    count: ir.Value  # scalar: counted rows, at least 1
    labels: ir.Value  # [N, 1] the labels, ignored ones as 0
    x: ir.Value  # [N, D]


def _columns(e: Emitter, w: ir.Value, start: int, size: int) -> ir.Value:
    return e.op("Slice", w, e.ints([start]), e.ints([start + size]), e.ints([1]))


def _chunked_forward(e: Emitter, head: _Head, rows: int, dim: int, vocabulary: int, columns: int) -> _Stats:
    x = e.reshape(head.x, [rows, dim])
    labels = e.reshape(head.labels, [rows])
    counted = e.op("Not", e.op("Equal", labels, e.const(np.array(IGNORE_INDEX, np.int64))))
    safe = e.reshape(e.op("Where", counted, labels, e.const(np.array(0, np.int64))), [rows, 1])
    weights = e.op("Cast", counted, to=head.w.dtype)
    count = e.op("Max", e.op("ReduceSum", weights, keepdims=0), e.scalar(1.0, head.w))
    zero = e.scalar(0.0, head.w)
    high = total = picked = None
    for start in range(0, vocabulary, columns):
        size = min(columns, vocabulary - start)
        logits = e.op("MatMul", x, _columns(e, head.w, start, size))
        chunk_high = e.op("ReduceMax", logits, e.ints([1]), keepdims=1)
        if high is None:
            high = chunk_high
            total = e.op("ReduceSum", e.op("Exp", e.op("Sub", logits, high)), e.ints([1]), keepdims=1)
        else:  # the running sum was taken against the old max: rescale it to the new one
            new_high = e.op("Max", high, chunk_high)
            rescaled = e.op("Mul", total, e.op("Exp", e.op("Sub", high, new_high)))
            fresh = e.op("ReduceSum", e.op("Exp", e.op("Sub", logits, new_high)), e.ints([1]), keepdims=1)
            high, total = new_high, e.op("Add", rescaled, fresh)
        local = e.op("Sub", safe, e.const(np.array(start, np.int64)))
        inside = e.op("And", e.op("GreaterOrEqual", local, e.const(np.array(0, np.int64))),
                      e.op("Less", local, e.const(np.array(size, np.int64))))
        index = e.op("Where", inside, local, e.const(np.array(0, np.int64)))
        chosen = e.op("Where", inside, e.op("GatherElements", logits, index, axis=1), zero)
        picked = chosen if picked is None else e.op("Add", picked, chosen)
    lse = e.op("Add", high, e.op("Log", total))
    per_row = e.reshape(e.op("Sub", lse, picked), [rows])
    loss = e.op("Div", e.op("ReduceSum", e.op("Mul", per_row, weights), keepdims=0), count)
    return _Stats(loss, lse, weights, count, safe, x)


def _chunked_backward(e: Emitter, head: _Head, stats: _Stats, seed: ir.Value, rows: int, vocabulary: int,
                      columns: int, want_x: bool, want_w: bool) -> tuple[ir.Value | None, ir.Value | None]:
    """dX and dW of seed * loss, one chunk of dlogits at a time."""
    if seed.dtype != head.w.dtype:
        seed = e.op("Cast", seed, to=head.w.dtype)
    scale = e.reshape(e.op("Mul", stats.weights, e.op("Div", seed, stats.count)), [rows, 1])
    dx = None
    dw_parts: list[ir.Value] = []
    for start in range(0, vocabulary, columns):
        size = min(columns, vocabulary - start)
        w = _columns(e, head.w, start, size)  # sliced again here: the forward's slices are not kept
        logits = e.op("MatMul", stats.x, w)
        probs = e.op("Exp", e.op("Sub", logits, stats.lse))
        classes = e.const(np.arange(start, start + size, dtype=np.int64).reshape(1, size))
        onehot = e.op("Cast", e.op("Equal", stats.labels, classes), to=head.w.dtype)
        dlogits = e.op("Mul", e.op("Sub", probs, onehot), scale)
        if want_w:
            dw_parts.append(e.op("MatMul", e.op("Transpose", stats.x, perm=[1, 0]), dlogits))
        if want_x:
            part = e.op("MatMul", dlogits, e.op("Transpose", w, perm=[1, 0]))
            dx = part if dx is None else e.op("Add", dx, part)
    if dx is not None:
        dx = e.reshape(dx, list(static_shape(head.x)))
    dw = None
    if dw_parts:
        dw = dw_parts[0] if len(dw_parts) == 1 else e.op("Concat", *dw_parts, axis=1)
    return dx, dw


def _take_place(old: ir.Value, new: ir.Value | None) -> None:
    """Readers of `old` read `new`; a graph output keeps its name and role (`P.grad`) on `new`."""
    assert new is not None
    output = old.is_graph_output()
    name, props = old.name, dict(old.metadata_props)
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if output:
        old.name = f"{name}/replaced"
        new.name = name
        new.metadata_props.update(props)
        new.shape, new.dtype = old.shape, old.dtype


def _drop_unused(graph: ir.Graph, candidates: list[ir.Node]) -> None:
    """Remove the candidates whose outputs nothing reads, until none is left to remove."""
    left = list(candidates)
    while True:
        dead = [n for n in left if all(o is None or (not o.uses() and not o.is_graph_output()) for o in n.outputs)]
        if not dead:
            return
        for node in dead:
            graph.remove(node, safe=True)
            left.remove(node)
