"""lower_recurrent: unroll ONNX RNN, GRU and LSTM over their static sequence length into primitive ops.

Rewrite (`LOWERINGS`, keyed by op type; the cells are `fblc.passes.recurrent_cells.CELLS`): for
each direction d (forward, reverse, or both for `bidirectional`), W_d and R_d are taken from W and
R (Split on the direction axis; transposed once), the input projection of every step is one MatMul
X [T*B, I] @ W_d^T plus the folded biases Wb + Rb (GRU with linear_before_reset keeps Rb_h inside
its gate) per group of gates (`Cell.groups`; GRU: one per gate, since a step's view split again into
gates would be copied: T=16 GRU 150 -> 129 launches), Split into T steps (views: the projection stays
live until the last step reads it), and the cell (MatMul of the state by R_d^T, Split into gates, the
activations, Mul/Add/Sub) runs T times, forward in time or backward. `sequence_lens` (ONNX
semantics, as onnxruntime): at step t of sample b with t >= len[b] the state is held (Where) and
Y is zero, so Y_h/Y_c are each sample's last valid state and the reverse direction starts at
len[b] - 1; a constant `sequence_lens` gives constant masks (none where every sample is long
enough), one fed at run time gives Less(t, len) per step. Y [T, D, B, H] is a Concat of the steps,
Y_h and Y_c a Concat of the directions' last states; `layout` 1 (batch first: X [B, T, I], states
[B, D, H], Y [B, T, D, H]) transposes on the way in and out. Only outputs that are read are built;
each keeps its name. Attributes: `activations` with `activation_alpha`/`activation_beta` (the
cells' ACTIVATIONS table; others are refused by name), `clip`, `input_forget`,
`linear_before_reset`, `hidden_size`; inputs initial_h, initial_c and LSTM's peepholes P.

Backpropagation through time is then autodiff over the unrolled graph: the backward reads each
step's gates and states, which stay live from the forward as saved values (T copies of every
gate activation; the memory plan and the memory report count them like any saved activation).

Preconditions: after lower_composites (the weights W, R, B may be Concat/Slice of the torch
parameters, which keep their own names and train), before infer_shapes. Needs static shapes of
X, W and R (the pass runs onnx's shape inference itself); a sequence length or batch that stays
dynamic is refused naming the node and the input. In place; `modified` is true when a node was
unrolled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fblc.compiler.graph import Emitter, attr, const_array, replace_output
from fblc.compiler.shapes import infer_shapes
from fblc.errors import ShapeError, UnsupportedOpError
from fblc.passes.contracts import ContractPass
from fblc.passes.recurrent_cells import CELLS, Cell, CellOptions, Weights, activations

DIRECTIONS = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}


@dataclass(frozen=True)
class Shape:
    steps: int
    batch: int
    inputs: int
    hidden: int
    directions: int
    batch_first: bool


def _string(node: ir.Node, name: str, default: str) -> str:
    value = attr(node, name, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _input(node: ir.Node, index: int) -> ir.Value | None:
    value = node.inputs[index] if index < len(node.inputs) else None
    return value if value is not None and value.name != "" else None


def _shape(node: ir.Node) -> Shape:
    x = node.inputs[0]
    assert x is not None
    dims = list(x.shape) if x.shape is not None else []
    batch_first = int(attr(node, "layout", 0)) == 1
    if len(dims) != 3 or not all(isinstance(d, int) for d in dims):
        raise ShapeError(f"{node.op_type} node '{node.name}': its input X '{x.name}' has shape {x.shape}, "
                         "so the sequence length it unrolls over is not known",
                         "give the model input's shape with --input-shape NAME=DIMS (a static sequence length "
                         "and batch), or export with fixed shapes")
    steps, batch = (dims[1], dims[0]) if batch_first else (dims[0], dims[1])
    w = node.inputs[1]
    assert w is not None
    if w.shape is None or not w.shape.is_static():
        raise ShapeError(f"{node.op_type} node '{node.name}': its weight W '{w.name}' has shape {w.shape}",
                         "W must have a static shape [directions, gates * hidden, input]")
    directions = len(DIRECTIONS.get(_string(node, "direction", "forward"), ()))
    hidden = int(attr(node, "hidden_size", int(w.shape[1]) // CELLS[node.op_type].gates))
    return Shape(int(steps), int(batch), int(dims[2]), hidden, directions, batch_first)


def _per_direction(e: Emitter, value: ir.Value, count: int, shape: list[int]) -> list[ir.Value]:
    """`value` [count, ...] as `count` tensors of `shape` (Split on axis 0, then Reshape)."""
    parts = [value] if count == 1 else list(e.op_multi("Split", value, e.ints([1] * count), axis=0,
                                                       num_outputs=count))
    return [e.reshape(p, shape) for p in parts]


def _masks(e: Emitter, node: ir.Node, s: Shape) -> list[ir.Value | None]:
    """Per step, the bool [B, 1] mask of samples still inside their sequence (None: every sample is)."""
    lens = _input(node, 4)
    if lens is None:
        return [None] * s.steps
    known = const_array(lens)
    if known is not None:
        lengths = np.asarray(known).reshape(-1).astype(np.int64)
        return [None if (lengths > t).all() else e.const((lengths > t).reshape(s.batch, 1)) for t in range(s.steps)]
    wide = e.reshape(e.op("Cast", lens, to=int(ir.DataType.INT64)), [s.batch, 1])
    return [e.op("Less", e.const(np.array(t, np.int64)), wide) for t in range(s.steps)]


def _options(node: ir.Node, cell: Cell, s: Shape) -> list[CellOptions]:
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in attr(node, "activations", [])]
    per = len(cell.defaults)
    if not names:
        names = list(cell.defaults) * s.directions
    elif len(names) == per and s.directions == 2:
        names = names * 2  # one direction's list for both, as onnxruntime reads it
    if len(names) != per * s.directions:
        raise UnsupportedOpError(f"{node.op_type} node '{node.name}' lists {len(names)} activations",
                                 f"it needs {per} per direction", ops=[node.op_type])
    acts = activations(node.op_type, node.name, names, list(attr(node, "activation_alpha", [])),
                       list(attr(node, "activation_beta", [])))
    clip = attr(node, "clip", None)
    return [CellOptions(s.hidden, acts[d * per:(d + 1) * per], None if clip is None else float(clip),
                        bool(attr(node, "input_forget", 0)), bool(attr(node, "linear_before_reset", 0)))
            for d in range(s.directions)]


def _projections(e: Emitter, x: ir.Value, w_t: ir.Value, bias: ir.Value | None, widths: list[int], s: Shape
                 ) -> list[list[ir.Value]]:
    """Per step, X_t W^T + bias in groups of `widths` columns: one MatMul over all steps per group, Split into
    the steps (each step's [B, width] is a view of it)."""
    groups = [w_t] if len(widths) == 1 else list(e.op_multi("Split", w_t, e.ints(widths), axis=1,
                                                                num_outputs=len(widths)))
    biases: list[ir.Value | None] = [None] * len(widths)
    if bias is not None:
        biases = [bias] if len(widths) == 1 else list(e.op_multi("Split", bias, e.ints(widths), axis=0,
                                                                 num_outputs=len(widths)))
    flat = e.reshape(x, [s.steps * s.batch, s.inputs])
    per_group = []
    for weight, b, width in zip(groups, biases, widths):
        projected = e.op("MatMul", flat, weight)
        if b is not None:
            projected = e.op("Add", projected, b)
        if s.steps == 1:
            per_group.append([e.reshape(projected, [s.batch, width])])
            continue
        pieces = e.op_multi("Split", e.reshape(projected, [s.steps, s.batch * width]), e.ints([1] * s.steps),
                            axis=0, num_outputs=s.steps)
        per_group.append([e.reshape(piece, [s.batch, width]) for piece in pieces])
    return [list(step) for step in zip(*per_group)]


@dataclass(frozen=True)
class Parts:
    """W, R, B and P split by direction (one Split each, shared by the directions): W_d [G*H, I], R_d [G*H, H],
    B_d [2*G*H], P_d [3*H]."""

    w: list[ir.Value]
    r: list[ir.Value]
    b: list[ir.Value] | None
    p: list[ir.Value] | None


def _parts(e: Emitter, node: ir.Node, cell: Cell, s: Shape) -> Parts:
    gh = cell.gates * s.hidden
    w, r, b = node.inputs[1], node.inputs[2], _input(node, 3)
    p = _input(node, 7) if node.op_type == "LSTM" else None
    assert w is not None and r is not None
    return Parts(_per_direction(e, w, s.directions, [gh, s.inputs]), _per_direction(e, r, s.directions, [gh, s.hidden]),
                 None if b is None else _per_direction(e, b, s.directions, [2 * gh]),
                 None if p is None else _per_direction(e, p, s.directions, [3 * s.hidden]))


def _direction(e: Emitter, node: ir.Node, cell: Cell, s: Shape, d: int, reverse: bool, x: ir.Value, parts: Parts,
               initial: list[ir.Value | None], masks: list[ir.Value | None], options: CellOptions
               ) -> tuple[list[ir.Value], ir.Value, ir.Value | None]:
    """One direction unrolled: its outputs in time order, its last h and c."""
    gh = cell.gates * s.hidden
    w_t = e.op("Transpose", parts.w[d])  # [I, G*H]
    r_t = e.op("Transpose", parts.r[d])  # [H, G*H]
    weights = Weights(r_t)
    folded: ir.Value | None = None
    if parts.b is not None:
        wb, rb = e.op_multi("Split", parts.b[d], e.ints([gh, gh]), axis=0, num_outputs=2)
        if node.op_type == "GRU" and options.linear_before_reset:  # Rb_h stays inside r * (H Rh^T + Rb_h)
            keep = np.concatenate([np.ones(2 * s.hidden), np.zeros(s.hidden)]).astype(np.float32)
            folded = e.op("Add", wb, e.op("Mul", rb, e.const(keep, dtype=rb.dtype)))
            weights.inner_bias = e.op("Slice", rb, e.ints([2 * s.hidden]), e.ints([gh]), e.ints([0]))
        else:
            folded = e.op("Add", wb, rb)
    if node.op_type == "GRU" and not options.linear_before_reset:
        weights.recurrent, weights.recurrent_h = e.op_multi("Split", r_t, e.ints([2 * s.hidden, s.hidden]), axis=1,
                                                            num_outputs=2)
    if parts.p is not None:
        pi, po, pf = e.op_multi("Split", parts.p[d], e.ints([s.hidden] * 3), axis=0, num_outputs=3)
        weights.peepholes = (pi, po, pf)
    steps = _projections(e, x, w_t, folded, [g * s.hidden for g in cell.groups], s)
    h, c = initial
    if h is None:
        h = e.const(np.zeros((s.batch, s.hidden)), dtype=x.dtype)
    if c is None and node.op_type == "LSTM":
        c = e.const(np.zeros((s.batch, s.hidden)), dtype=x.dtype)
    outputs: list[ir.Value | None] = [None] * s.steps
    zeros = e.const(np.zeros(()), dtype=x.dtype)
    for t in (reversed(range(s.steps)) if reverse else range(s.steps)):
        new_h, new_c = cell.step(e, steps[t], h, c, weights, options)
        mask = masks[t]
        if mask is None:
            outputs[t], h, c = new_h, new_h, new_c
        else:
            outputs[t] = e.op("Where", mask, new_h, zeros)
            h = e.op("Where", mask, new_h, h)
            c = None if c is None or new_c is None else e.op("Where", mask, new_c, c)
    return [o for o in outputs if o is not None], h, c


def _used(value: ir.Value | None, graph: ir.Graph) -> bool:
    return value is not None and value.name != "" and (bool(value.uses()) or value in graph.outputs)


def _unroll(e: Emitter, node: ir.Node) -> None:
    cell = CELLS[node.op_type]
    s = _shape(node)
    direction = _string(node, "direction", "forward")
    if direction not in DIRECTIONS:
        raise UnsupportedOpError(f"{node.op_type} node '{node.name}' has direction '{direction}'",
                                 f"ONNX defines {', '.join(DIRECTIONS)}", ops=[node.op_type])
    options = _options(node, cell, s)
    x = node.inputs[0]
    assert x is not None
    if s.batch_first:
        x = e.op("Transpose", x, perm=[1, 0, 2])
    initial: list[list[ir.Value | None]] = [[None, None] for _ in range(s.directions)]
    for slot, index in ((0, 5), (1, 6)):
        state = _input(node, index)
        if state is None or (index == 6 and node.op_type != "LSTM"):
            continue
        if s.batch_first:
            state = e.op("Transpose", state, perm=[1, 0, 2])
        for d, part in enumerate(_per_direction(e, state, s.directions, [s.batch, s.hidden])):
            initial[d][slot] = part
    masks = _masks(e, node, s)
    parts = _parts(e, node, cell, s)
    results = [_direction(e, node, cell, s, d, reverse, x, parts, initial[d], masks, options[d])
               for d, reverse in enumerate(DIRECTIONS[direction])]
    outputs = list(node.outputs) + [None] * (3 - len(node.outputs))
    if _used(outputs[0], e.graph):
        per_direction = [e.op("Concat", *[e.reshape(o, [1, 1, s.batch, s.hidden]) for o in steps], axis=0)
                         for steps, _, _ in results]
        y = per_direction[0] if s.directions == 1 else e.op("Concat", *per_direction, axis=1)
        _take(outputs[0], e.op("Transpose", y, perm=[2, 0, 1, 3]) if s.batch_first else y)
    for slot, output in ((1, outputs[1]), (2, outputs[2])):
        if not _used(output, e.graph):
            continue
        last = [r[slot] for r in results]
        stacked = e.op("Concat", *[e.reshape(v, [1, s.batch, s.hidden]) for v in last if v is not None], axis=0)
        assert output is not None
        _take(output, e.op("Transpose", stacked, perm=[1, 0, 2]) if s.batch_first else stacked)


def _take(old: ir.Value, new: ir.Value) -> None:
    replace_output(old, new, suffix="recurrent")


LOWERINGS: dict[str, Cell] = CELLS


class LowerRecurrent(ContractPass):
    """Unroll RNN, GRU and LSTM nodes over their static sequence length (in place)."""

    name = "lower_recurrent"
    requires_facts = ("static inputs",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        pending = [n for n in graph if n.domain in ("", "ai.onnx") and n.op_type in LOWERINGS]
        if not pending:
            return ir.passes.PassResult(model, False)
        infer_shapes(model, require_static=False)
        emitter = Emitter(graph, stage="forward")
        for node in pending:
            emitter.anchor, emitter.prefix = node, f"{node.name}/unrolled"
            _unroll(emitter, node)
            graph.remove(node, safe=True)
        return ir.passes.PassResult(model, True)
