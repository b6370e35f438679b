"""chunk_loss: the cross-entropy over a large vocabulary in column chunks, so [T, V] logits never exist whole.

A language model's loss reads logits z = X W (W [D, V], V the vocabulary: 128256 for Llama 3) through
LogSoftmax; the backward saves log-probabilities [T, V] and makes dz [T, V]. Where V is large this pass
replaces the LM-head MatMul, the loss and their backward by chunks of C columns (the last one shorter
where C does not divide V):
- forward: per chunk z_c = X W[:, c], its row max m_c and sum s_c of exp(z_c - m_c); then m = max m_c,
  s = sum s_c exp(m_c - m) (the log-sum-exp over chunks); the label's logit is gathered from the chunk that holds
  it (the others give exact zeros: nothing reads the whole W); what stays for the backward is lse = m + log s, one
  value per row;
- backward: per chunk z_c again (recomputed: one more MatMul per chunk), dz_c = (exp(z_c - lse) -
  onehot_c) * w / count * seed, consumed at once by dW_c = X^T dz_c and dX += dz_c W[:, c]^T.
So the largest loss temporary is [T, C] instead of [T, V]; dW is the chunks' columns concatenated.
A quantized head (DequantizeLinear of initializers, blocks along K) is cut at compile time: each chunk reads a
DequantizeLinear of its own slice of the integers and scales, which its MatMuls dequantize as they load
(fuse.DEQUANTIZING_READS; a Slice at an offset is no view a contraction reads, so slicing the float weight would
materialise it); the whole head's integers leave the graph. A head tied to the embedding (one [V, D] table read by
the embedding Gather and, transposed, by the head: Llama-3.2-1B) is cut the same way and the Gather reads the chunks
(compiler/vocabulary_chunks.gather_from_chunks), so the table is stored once.

Rewrite: the loss Identity reads the chunked loss; the backward nodes that the gradient pass wrote for
the MatMul and the loss go, their exits (dX, dW, by shape) read the chunked gradients instead.
Options: `chunk` (TrainingOptions.loss_chunk): columns per chunk, 0 off, -1 auto (AUTO_CHUNK columns
where V >= AUTO_FROM). Only the cross-entropy over a MatMul's logits that nothing else reads is chunked;
any other loss or shape leaves the graph unchanged (`modified` false, the reason in `self.skipped`; the match
is passes/lm_head.py's).
Preconditions: attach_loss ran; after the gradient pass (backprop: seed 1 or the state `loss_scale`)
where there is one; under ES before es_gradients (forward only: its members copy the chunked forward, so no
member's [T, V] logits exist), with a reward that reads the loss alone (the logits are gone). In place.
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
from fblc.compiler.vocabulary_chunks import dequantized_chunk, gather_from_chunks
from fblc.compiler.losses import IGNORE_INDEX
from fblc.passes.contracts import ContractPass
from fblc.passes.lm_head import _backward_of, _find_head, _Head, _Term

AUTO_CHUNK = 8192  # columns: [256, 8192] fp32 is 8 MiB, one Llama-3 logits row block 1/16 of the whole
AUTO_FROM = 16384  # vocabularies from here on are chunked by default (BERT's 30522 and GPT-2's 50257 are)


def chunk_columns(chunk: int, vocabulary: int) -> int:
    """Columns per chunk for option `chunk` (0 off, -1 auto) over `vocabulary` classes; 0: not chunked."""
    if chunk < 0:
        return AUTO_CHUNK if vocabulary >= AUTO_FROM else 0
    return chunk if 0 < chunk < vocabulary else 0


class ChunkLoss(ContractPass):
    """Cross-entropy over vocabulary chunks, forward and backward (in place)."""

    name = "chunk_loss"
    #: after the gradient pass where there is one (its backward of the head is replaced); without one (a
    #: forward-only step) only the forward is chunked
    requires_facts = ("static shapes", "loss")
    ensures_facts = ("static shapes", "loss")

    def __init__(self, chunk: int = -1, loss: str = "cross_entropy", members: bool = False) -> None:
        super().__init__()
        self.chunk, self.loss = chunk, loss
        #: before es_gradients, whose members copy the chunked forward: a chunk sliced at run time from a weight
        #: that reads no parameter would be made once and held by every member (the whole head again), so only
        #: quantized heads (sliced at compile time) and trained weights are chunked
        self.members = members
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
        vocabulary = static_shape(head.terms[0].w)[1]
        columns = chunk_columns(self.chunk, vocabulary)
        if columns == 0:
            self.skipped = f"vocabulary {vocabulary} below the chunk"
            return ir.passes.PassResult(model, False)
        held = [t.rows or t.w for t in head.terms if self.members and t.dequantize is None
                and keys.get_role(t.rows or t.w) != Role.PARAM.value]
        if held:
            self.skipped = (f"the LM head's weight '{held[0].name}' is not quantized: its chunks would be Slices made "
                            "once and held by every ES member (a whole copy of the head); --weights int4|int8 cuts them "
                            "at compile time")
            return ir.passes.PassResult(model, False)
        head_nodes = [*head.adds, *(n for t in head.terms for n in t.nodes)]
        backward = _backward_of(graph, [*head_nodes, head.identity, *head.loss_nodes])
        owned = {id(n) for n in backward}
        exits = [o for n in backward for o in n.outputs
                 if o is not None and (o.is_graph_output() or any(id(r) not in owned for r, _ in o.uses()))]
        shapes = _exit_shapes(head.terms)
        if shapes is None or any(static_shape(v) not in shapes for v in exits):
            self.skipped = "the head's backward has exits other than each term's dX, dW and dW^T, told apart by shape"
            return ir.passes.PassResult(model, False)
        wanted = {shapes[static_shape(v)] for v in exits}
        rows = math.prod(static_shape(head.terms[0].x)[:-1])
        forward = Emitter(graph, stage="loss")
        forward.anchor = head.identity
        position = {id(n): i for i, n in enumerate(graph)}
        for term in head.terms:  # the chunks go before the first Gather that comes to read them
            term.gathers.sort(key=lambda n: position[id(n)])
        stats = _chunked_forward(forward, head, rows, vocabulary, columns)
        for term in head.terms:
            for gather in term.gathers:
                gather_from_chunks(gather, sorted(term.chunks.items()), vocabulary)
        head.identity.replace_input_with(0, stats.loss)
        if exits:
            grad = Emitter(graph, stage="backward")
            grad.anchor = backward[0]
            seed = next((v for v in graph.inputs if v.name == SCALE), None) or grad.scalar(1.0, stats.loss)
            grads = _chunked_backward(grad, head, stats, seed, rows, vocabulary, columns, wanted)
            for value in exits:
                _take_place(value, grads[shapes[static_shape(value)]])
        graph.remove(backward, safe=True)
        whole = [t.dequantize for t in head.terms if t.dequantize is not None]
        stored = [v for n in whole for v in n.inputs if v is not None]  # (removing a node detaches its inputs)
        _drop_unused(graph, [*head.loss_nodes, *head_nodes, *whole])
        for value in stored:  # the whole integers and scales: the chunks' slices hold them now
            if not value.uses() and graph.initializers.get(value.name) is value:
                graph.initializers.pop(value.name)
        for value in [stats.lse, stats.weights, stats.count, stats.labels, *(t.x for t in head.terms),
                      *(t.rows or t.w for t in head.terms if t.dequantize is None)] if exits else []:
            if keys.get_role(value) is None:
                keys.set_role(value, Role.SAVED)
        return ir.passes.PassResult(model, True)


def _exit_shapes(terms: list[_Term]) -> dict[tuple[int, ...], tuple[str, int]] | None:
    """Each gradient the head's backward may hand on, by its shape: ("x" | "w" | "rows", term); None where
    two of them share a shape (the exits could not be told apart)."""
    shapes: dict[tuple[int, ...], tuple[str, int]] = {}
    for index, term in enumerate(terms):
        w_shape = static_shape(term.w)
        for shape, kind in ((static_shape(term.x), "x"), (w_shape, "w"), (w_shape[::-1], "rows")):
            if shape in shapes:
                return None
            shapes[shape] = (kind, index)
    return shapes


@dataclass
class _Stats:
    loss: ir.Value
    lse: ir.Value  # [N, 1] log-sum-exp of each row's logits
    weights: ir.Value  # [N] 1 where the label counts, else 0
    count: ir.Value  # scalar: counted rows, at least 1
    labels: ir.Value  # [N, 1] the labels, ignored ones as 0
    xs: list[ir.Value]  # each term's x as [N, K]


def _columns(e: Emitter, term: _Term, start: int, size: int) -> tuple[ir.Value, ir.Value]:
    """W[:, start:start+size] [K, size] and its transpose: views of the weight, sliced where it is stored (a
    quantized one: a DequantizeLinear of the chunk's own integers and scales)."""
    axis = term.vocabulary_axis
    if term.dequantize is not None:
        stored = _dequantized_chunk(e, term, start, size)
    else:
        stored = e.op("Slice", term.rows if term.rows is not None else term.w, e.ints([start]),
                      e.ints([start + size]), e.ints([axis]))
    transposed = e.op("Transpose", stored, perm=[1, 0])
    return (transposed, stored) if term.rows is not None else (stored, transposed)


def _dequantized_chunk(e: Emitter, term: _Term, start: int, size: int) -> ir.Value:
    """The quantized head's chunk [start, start + size) along the vocabulary (vocabulary_chunks.dequantized_chunk),
    made once per chunk: before the tied embedding's Gathers where there are some (they read the chunks too)."""
    assert term.dequantize is not None
    anchor = term.gathers[0] if term.gathers else e.anchor
    assert anchor is not None
    return dequantized_chunk(term.dequantize, term.vocabulary_axis, start, size, anchor, term.chunks)


def _chunk_logits(e: Emitter, head: _Head, xs: list[ir.Value], start: int, size: int
                  ) -> tuple[ir.Value, list[ir.Value]]:
    """z[:, start:start+size] = sum of x W[:, chunk] over the terms, and each term's W chunk transposed."""
    logits, transposed = None, []
    for term, x in zip(head.terms, xs):
        w, w_t = _columns(e, term, start, size)
        part = e.op("MatMul", x, w)
        logits = part if logits is None else e.op("Add", logits, part)
        transposed.append(w_t)
    assert logits is not None
    return logits, transposed


def _onehot(e: Emitter, labels: ir.Value, start: int, size: int, dtype: ir.DataType) -> ir.Value:
    """[N, size]: 1 where a row's label (labels [N, 1]) is class start + j of the chunk, else 0."""
    classes = e.const(np.arange(size, dtype=np.int64).reshape(1, size))  # shared by the chunks of one size
    local = e.op("Sub", labels, e.const(np.array(start, np.int64)))
    return e.op("Cast", e.op("Equal", local, classes), to=dtype)


def _picked(e: Emitter, logits: ir.Value, labels: ir.Value, start: int, size: int) -> ir.Value:
    """[N, 1]: each row's label logit where the chunk [start, start + size) holds the label, else an exact zero (the
    chunks' picks summed give the label's logit: no read of the whole head). Gathered, not a one-hot product: a
    one-hot [N, size] reads the labels alone, so where the forward is repeated (the ES members) it would be made
    once and held, every chunk's, for the whole step."""
    zero = e.const(np.array(0, np.int64))
    local = e.op("Sub", labels, e.const(np.array(start, np.int64)))
    inside = e.op("And", e.op("GreaterOrEqual", local, zero), e.op("Less", local, e.const(np.array(size, np.int64))))
    picked = e.op("GatherElements", logits, e.op("Where", inside, local, zero), axis=1)
    return e.op("Where", inside, picked, e.scalar(0.0, logits))


def _chunked_forward(e: Emitter, head: _Head, rows: int, vocabulary: int, columns: int) -> _Stats:
    """The loss and the log-sum-exp of each row. Each chunk's max and sum of exponentials (against its own max)
    are made apart and joined once, by a Concat: an elementwise op reading two chunks' reductions would let
    fuse put every chunk's reduction into one kernel, and every chunk's logits would then live at once."""
    dtype_of = head.terms[0].w
    xs = [e.reshape(t.x, [rows, static_shape(t.x)[-1]]) for t in head.terms]
    labels = e.reshape(head.labels, [rows])
    counted = e.op("Not", e.op("Equal", labels, e.const(np.array(IGNORE_INDEX, np.int64))))
    safe = e.op("Where", counted, labels, e.const(np.array(0, np.int64)))
    weights = e.op("Cast", counted, to=dtype_of.dtype)
    count = e.op("Max", e.op("ReduceSum", weights, keepdims=0), e.scalar(1.0, dtype_of))
    column = e.reshape(safe, [rows, 1])
    highs, sums, picks = [], [], []
    for start in range(0, vocabulary, columns):
        size = min(columns, vocabulary - start)
        logits = _chunk_logits(e, head, xs, start, size)[0]
        high = e.op("ReduceMax", logits, e.ints([1]), keepdims=1)
        highs.append(high)
        sums.append(e.op("ReduceSum", e.op("Exp", e.op("Sub", logits, high)), e.ints([1]), keepdims=1))
        picks.append(_picked(e, logits, column, start, size))
    high_each = e.op("Concat", *highs, axis=1)  # [N, chunks]
    high = e.op("ReduceMax", high_each, e.ints([1]), keepdims=1)
    rescaled = e.op("Mul", e.op("Concat", *sums, axis=1), e.op("Exp", e.op("Sub", high_each, high)))
    lse = e.op("Add", high, e.op("Log", e.op("ReduceSum", rescaled, e.ints([1]), keepdims=1)))
    picked = e.op("ReduceSum", e.op("Concat", *picks, axis=1), e.ints([1]), keepdims=1)
    per_row = e.reshape(e.op("Sub", lse, picked), [rows])
    loss = e.op("Div", e.op("ReduceSum", e.op("Mul", per_row, weights), keepdims=0), count)
    return _Stats(loss, lse, weights, count, column, xs)


def _chunked_backward(e: Emitter, head: _Head, stats: _Stats, seed: ir.Value, rows: int, vocabulary: int,
                      columns: int, wanted: set[tuple[str, int]]) -> dict[tuple[str, int], ir.Value]:
    """The gradients of seed * loss in `wanted`, by (kind, term): "x" (dX), "w" (dW [K, V]), "rows" (dW^T
    [V, K]), one chunk of dlogits at a time."""
    dtype = head.terms[0].w.dtype
    if seed.dtype != dtype:
        seed = e.op("Cast", seed, to=dtype)
    scale = e.reshape(e.op("Mul", stats.weights, e.op("Div", seed, stats.count)), [rows, 1])
    dxs: dict[int, ir.Value] = {}
    parts: dict[tuple[str, int], list[ir.Value]] = {key: [] for key in wanted}
    for start in range(0, vocabulary, columns):
        size = min(columns, vocabulary - start)
        # recomputed here: nothing of the forward's chunk is kept
        logits, transposed = _chunk_logits(e, head, stats.xs, start, size)
        probs = e.op("Exp", e.op("Sub", logits, stats.lse))
        dlogits = e.op("Mul", e.op("Sub", probs, _onehot(e, stats.labels, start, size, dtype)), scale)
        for index, (x, w_t) in enumerate(zip(stats.xs, transposed)):
            if ("w", index) in wanted:
                parts["w", index].append(e.op("MatMul", e.op("Transpose", x, perm=[1, 0]), dlogits))
            if ("rows", index) in wanted:
                parts["rows", index].append(e.op("MatMul", e.op("Transpose", dlogits, perm=[1, 0]), x))
            if ("x", index) in wanted:
                part = e.op("MatMul", dlogits, w_t)
                # the chunk's product first: the Add joins its MatMul's epilogue (with the running sum first, fuse
                # would grow the first chunk's kernel by every later Add and launch it last)
                dxs[index] = part if index not in dxs else e.op("Add", part, dxs[index])
    grads = {("x", index): e.reshape(dx, list(static_shape(head.terms[index].x))) for index, dx in dxs.items()}
    for (kind, index), pieces in parts.items():
        if kind != "x":
            grads[kind, index] = pieces[0] if len(pieces) == 1 else \
                e.op("Concat", *pieces, axis=1 if kind == "w" else 0)
    return grads


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
