"""sort_scatter_rows: a long row scatter finds its updates by binary search in sorted row numbers.

Rewrite, for a scatter of whole rows (ROW_SCATTERS: Y = ScatterElements(data, Expand(rows), updates,
axis), the segment sums of gather gradients, fblc/compiler/gradients/segment_sum.py, where `rows`
has extent 1 after `axis` and the updates cover the data off `axis`; Y = ScatterElements(data,
indices, updates, axis) along the data's last axis, GatherElements' gradient, whose rows are single
elements of each line; or Y = ScatterND(data, rows [.., k], updates), each k-tuple a row of the
data's first k axes, flattened: its row number is sum_j wrap(index_j) * stride_j, made by
segment_sum.tuple_rows as for GatherND's gradient, and the data and Y are seen as [rows, ..])
with more than SORTED_SCATTER_UPDATES updates on a line:
- K0 = Reshape(rows, [G, N]) (G = 1 when the rows are shared by the leading axes, else their extent);
- (K, P) = MergeRuns(K0, run=1), then MergeRuns(K, P, run=2, 4, ..) until one run holds the line:
  a stable merge sort of the row numbers (wrapped like ONNX's negative indices) and their
  positions P, one kernel per doubling (fblc's device-only ops, fblc/codegen/kernels/sort.py);
- Y = ScatterSortedRows(data, K, P, updates (ScatterND's viewed [N, row..]), axis, reduction), with
  no data (and a `shape` attribute) when data is a known zero table: the rows start from 0 and the
  table is never made.
Y keeps its value (name, shape, readers).

Why: the ScatterElements kernel has each target row scan every update's row number, D x N
reads for a table of D rows (an embedding's gradient: 32,000 rows x 2,048 token ids took 1.4 s
on PoCL). After the sort a target row finds its first update in log2(N) reads and reads only its
own. The sort is stable, so a row still folds its updates in update order: the same float sums,
bit for bit, as onnxruntime's ScatterElements and the unsorted kernel.

Preconditions: the step graph, static shapes; device-only (after the step ONNX is written, like
es_noise): onnxruntime has no MergeRuns. In place; the new nodes keep the scatter's stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.gradients.segment_sum import tuple_rows
from fblc.compiler.graph import Emitter, attr, replace_output, static_shape
from fblc.compiler.index_map import is_zeros
from fblc.compiler.values import numel
from fblc.passes.contracts import ContractPass
from fblc.profiles.profile import SORTED_SCATTER_UPDATES


@dataclass(frozen=True)
class RowScatter:
    """A scatter of whole rows along `axis`: `count` row numbers `rows` (per leading index: `groups` lines,
    1 when shared) and updates that read as [leading.., count, rest of the data's axes..] (`updates_shape`).
    With `tuple_axes` k > 1 each row number is a k-tuple [.., k] of the data's first k axes (ScatterND),
    whose rows are their flattened positions."""

    rows: ir.Value
    groups: int
    axis: int
    count: int
    updates_shape: tuple[int, ...]
    tuple_axes: int = 1

    def data_shape(self, data_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The data as the sorted scatter sees it: the tuple axes flattened into one axis of rows."""
        k = self.tuple_axes
        return (numel(data_shape[:k]), *data_shape[k:]) if k > 1 else tuple(data_shape)


def expanded_rows(node: ir.Node) -> tuple[ir.Value, tuple[int, ...], int] | None:
    """(rows, their shape padded to the data's rank, axis) when a ScatterElements scatters whole rows: its
    indices are an Expand of `rows`, whose extent is 1 after `axis` (one target row per update, the same
    for the row's elements), and the indices cover the data off `axis` (a gather's segment sum)."""
    data, indices = node.inputs[:2]
    producer = indices.producer()
    if producer is None or producer.op_type != "Expand":
        return None
    data_shape, index_shape = static_shape(data), static_shape(indices)
    rows = producer.inputs[0]
    source = static_shape(rows)
    if not data_shape or not index_shape or source is None or len(source) > len(index_shape):
        return None
    rank = len(data_shape)
    axis = int(attr(node, "axis", 0)) % rank
    source = (1,) * (rank - len(source)) + tuple(source)
    covers = all(index_shape[k] == data_shape[k] for k in range(rank) if k != axis)
    if not (covers and index_shape[axis] > 0 and all(d == 1 for d in source[axis + 1:])):
        return None
    return rows, source, axis


def _scatter_elements_rows(node: ir.Node) -> RowScatter | None:
    """A row scatter (expanded_rows) whose rows are, before `axis`, either all 1 (shared) or the indices' own;
    else a scatter of single elements along the data's last axes (_scatter_elements_lines)."""
    found = expanded_rows(node)
    if found is None:
        return _scatter_elements_lines(node)
    rows, source, axis = found
    index_shape = static_shape(node.inputs[1])
    leading, count = source[:axis], index_shape[axis]
    shared = all(d == 1 for d in leading)
    if source[axis] != count or not (shared or leading == index_shape[:axis]):
        return None
    return RowScatter(rows, 1 if shared else numel(leading), axis, count, tuple(index_shape))


def _scatter_elements_lines(node: ir.Node) -> RowScatter | None:
    """ScatterElements along an axis after which the data has only axes of 1 (GatherElements' gradient
    along the last axis): each update targets one element of its line, a row of one element, and the
    indices are the data's lines' own (equal extents before `axis`)."""
    data, indices = node.inputs[:2]
    data_shape, index_shape = static_shape(data), static_shape(indices)
    if not data_shape or not index_shape or len(index_shape) != len(data_shape):
        return None
    axis = int(attr(node, "axis", 0)) % len(data_shape)
    if any(d != 1 for d in data_shape[axis + 1:]) or tuple(index_shape[:axis]) != tuple(data_shape[:axis]) \
            or any(d != 1 for d in index_shape[axis + 1:]) or index_shape[axis] == 0:
        return None
    return RowScatter(indices, numel(index_shape[:axis]), axis, index_shape[axis], tuple(index_shape))


def _scatter_nd_rows(node: ir.Node) -> RowScatter | None:
    """ScatterND of k-tuples: each update writes a whole row of the data (a slice along axis 0; for k > 1
    an element of its first k axes, flattened)."""
    data, indices = node.inputs[:2]
    data_shape, index_shape = static_shape(data), static_shape(indices)
    if not data_shape or not index_shape or not 1 <= index_shape[-1] <= len(data_shape):
        return None
    count, k = numel(index_shape[:-1]), index_shape[-1]
    return RowScatter(indices, 1, 0, count, (count, *data_shape[k:]), k)


#: op type -> the row scatter it is, if it is one
ROW_SCATTERS: dict[str, Callable[[ir.Node], RowScatter | None]] = {
    "ScatterElements": _scatter_elements_rows, "ScatterND": _scatter_nd_rows}


def sortable_rows(node: ir.Node) -> RowScatter | None:
    """The row scatter `node` is, when sorting pays for it (more than SORTED_SCATTER_UPDATES updates a line)."""
    if node.op_type not in ROW_SCATTERS or node.domain not in ("", "ai.onnx"):
        return None
    found = ROW_SCATTERS[node.op_type](node)
    return found if found is not None and found.count > SORTED_SCATTER_UPDATES else None


def _sort(graph: ir.Graph, node: ir.Node, scatter: RowScatter) -> None:
    data, indices, updates = node.inputs[:3]
    data_shape = tuple(static_shape(data))
    rows_shape = scatter.data_shape(data_shape)
    depth, reduction = rows_shape[scatter.axis], attr(node, "reduction", "none")
    e = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "backward"))
    e.anchor, e.prefix = node, f"{node.name}/sorted"
    e.origin = node.metadata_props.get(keys.GRAD_OF)
    k = scatter.tuple_axes
    rows = tuple_rows(e, scatter.rows, data_shape[:k]) if k > 1 else scatter.rows
    sorted_rows, positions, run = e.reshape(rows, [scatter.groups, scatter.count]), None, 1
    while run < scatter.count:  # each doubling merges neighbouring sorted runs of `run` row numbers
        sorted_rows, positions = e.op_multi("MergeRuns", sorted_rows, positions, num_outputs=2, run=run, depth=depth)
        run *= 2
    if tuple(static_shape(updates)) != scatter.updates_shape:
        updates = e.reshape(updates, list(scatter.updates_shape))
    zeros = is_zeros(data)
    if not zeros and rows_shape != data_shape:
        data = e.reshape(data, list(rows_shape))
    result = e.op("ScatterSortedRows", None if zeros else data, sorted_rows, positions, updates, axis=scatter.axis,
                  reduction=reduction.decode() if isinstance(reduction, bytes) else reduction,
                  shape=list(rows_shape) if zeros else None)
    if rows_shape != data_shape:
        result = e.reshape(result, list(data_shape))
    y, unread = node.outputs[0], [indices.producer(), data.producer() if zeros else None]
    replace_output(y, result, "unsorted")
    graph.remove(node, safe=True)
    for producer in unread:  # the broadcast row numbers, the zero table: removed unless another node reads them
        if producer is not None and not any(out.uses() or out.is_graph_output() for out in producer.outputs):
            graph.remove(producer, safe=True)


class SortScatterRows(ContractPass):
    """Rewrite long row scatters into a stable merge sort of their row numbers and a sorted scatter (in place)."""

    name = "sort_scatter_rows"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        found = [(n, scatter) for n in graph if (scatter := sortable_rows(n)) is not None]
        for node, scatter in found:
            _sort(graph, node, scatter)
        return ir.passes.PassResult(model, bool(found))

