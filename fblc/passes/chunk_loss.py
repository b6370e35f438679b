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
any other loss or shape leaves the graph unchanged (`modified` false, the reason in `self.skipped`).
Preconditions: attach_loss ran; after the gradient pass (backprop: seed 1 or the state `loss_scale`)
where there is one; under ES before es_gradients (forward only: its members copy the chunked forward, so no
member's [T, V] logits exist), with a reward that reads the loss alone (the logits are gone). In place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, static_shape
from fblc.compiler.keys import Role
from fblc.compiler.loss_scale import SCALE
from fblc.compiler.vocabulary_chunks import dequantized_chunk, embedding_gather, gather_from_chunks
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
