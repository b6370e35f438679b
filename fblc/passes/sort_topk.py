"""sort_topk: a TopK over a long line as a stable merge sort of the line, then its first k.

Rewrite, for Y, I = TopK(X, k, axis, largest) with a line of n > SORTED_TOPK_LINE elements where the
sort reads less than the selection kernel (sort_reads against n k (k + 1) / 2):
- V0 = X with `axis` moved last (a Transpose when it is not), viewed [G, n]; negated when largest;
- the line padded to a power of two with +inf (sorting last), (V, P) = MergeRuns(V0, positions, run=1),
  then run=2, 4, .. until one run holds the line: a stable merge sort, fblc's device-only op
  (fblc/codegen/kernels/sort.py, sort_scatter_rows' own); once runs are longer than k, only each run's
  first k can reach the result, so each merge is followed by a Slice of every run's first k and the
  line halves;
- Y = the first k of V (negated back when largest: exact), I = the first k of P, moved back to `axis`.
Ascending and stable, so ties keep the lower index first, as onnxruntime's TopK and fblc's kernel
order them, for largest and smallest alike; sorted=0 allows any order, and gets this one.
Y and I keep their values (names, readers: the gradient rule's scatter reads I).

Why: the TopK kernel (fblc/codegen/kernels/scan.py) has the lane of rank r scan the line r + 1 times,
O(n k^2) a line (O(n^3) for a full sort). A MergeRuns work-item writes consecutive outputs, one binary search
for its first and O(1) for each later one (merge_texels), so each launch reads O(1) per output: log2 k
doublings over the whole line, then lines that halve, O(n log k) a line in log2 n launches (until eb77db5,
a search per output: O(n log^2 k)).

Preconditions: the step graph, static shapes, k a constant; device-only (after the step ONNX is
written, like sort_scatter_rows): onnxruntime has no MergeRuns. In place; new nodes keep TopK's stage.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, replace_output, static_shape
from fblc.compiler.values import ints_input, numel
from fblc.passes.contracts import ContractPass
from fblc.profiles.profile import SORTED_TOPK_LINE


def merge_texels(run: int, texels: int) -> int:
    """Texels a MergeRuns work-item writes in turn (its outputs consecutive): enough that its one binary search,
    about log2(2 run) steps, costs at most one step per output (each later output resumes the merge: O(1)),
    so a merge of n outputs reads O(n), not O(n log run); the largest power of two up to that which divides
    the output's `texels` (a work-item holds whole texels of one tile)."""
    steps = (2 * run).bit_length()
    per = 1
    while 4 * per < steps and texels % (2 * per) == 0:
        per *= 2
    return per


#: reads per output of a MergeRuns lane besides its search: the two keys it compares, its pick's key and position
PICK_READS = 4


def launches(n: int, k: int) -> list[tuple[int, int]]:
    """(outputs per line, run) of each MergeRuns launch of a line of n keeping its first k (padded to a power of
    two; once runs are longer than k, each keeps its first k and the line halves)."""
    length, run, out = 1 << max(n - 1, 0).bit_length(), 1, []
    while run < length:
        out.append((length, run))
        run *= 2
        if k < run < length:
            length, run = length // run * k, k
    return out


def sort_reads(n: int, k: int, resumed: bool = True) -> int:
    """Element reads of the merge sort of a line of n down to its first k: per output PICK_READS and, per
    binary search, two a step (about log2(2 run) steps); `resumed`: one search a work-item of merge_texels
    texels (this tree's kernel), else one per output (eb77db5's)."""
    reads = 0
    for length, run in launches(n, k):
        per = 4 * merge_texels(run, length // 4) if resumed and length % 4 == 0 else 1
        reads += length * PICK_READS + -(-length // per) * 2 * (2 * run).bit_length()
    return reads


def sort_pays(n: int, k: int) -> bool:
    """Whether merge-sorting a line of n reads less than the kernel's selection of its first k (module docstring)."""
    return n > SORTED_TOPK_LINE and n * k * (k + 1) // 2 > sort_reads(n, k)


def _sortable(node: ir.Node) -> tuple[int, int] | None:
    """(axis, k) of a TopK the sort pays for, else None."""
    if node.op_type != "TopK" or node.domain not in ("", "ai.onnx"):
        return None
    shape, k = static_shape(node.inputs[0]), ints_input(node, 1, "K")
    if not shape or not k:
        return None
    axis = int(attr(node, "axis", -1)) % len(shape)
    return (axis, k[0]) if sort_pays(shape[axis], k[0]) else None


def _heads(e: Emitter, line: ir.Value, groups: int, runs: int, run: int, k: int) -> ir.Value:
    """The first k of each sorted run of `run` in lines [groups, runs * run]: [groups, runs * k]."""
    first = e.op("Slice", e.reshape(line, [groups, runs, run]), e.ints([0]), e.ints([k]), e.ints([2]))
    return e.reshape(first, [groups, runs * k])


def _sort(graph: ir.Graph, node: ir.Node, axis: int, k: int) -> None:
    x = node.inputs[0]
    shape = list(static_shape(x))
    rank, n = len(shape), shape[axis]
    largest = bool(int(attr(node, "largest", 1)))
    e = Emitter(graph, stage=node.metadata_props.get(keys.STAGE, "forward"))
    e.anchor, e.prefix = node, f"{node.name}/sorted"
    e.origin = node.metadata_props.get(keys.GRAD_OF)
    order = [a for a in range(rank) if a != axis] + [axis]  # the axis last
    moved = [shape[a] for a in order]
    lines = x if axis == rank - 1 else e.op("Transpose", x, perm=order)
    lines = e.reshape(lines, [numel(moved[:-1]), n])
    values = e.op("Neg", lines) if largest else lines
    groups, length = numel(moved[:-1]), 1 << max(n - 1, 0).bit_length()  # the line padded to a power of two
    positions = e.op("Expand", e.const(np.arange(length, dtype=np.int64).reshape(1, length)),
                     e.ints([groups, length]))
    if length > n:  # +inf sorts last; stable, so an element of value +inf (a lower index) stays ahead of them
        values = e.op("Concat", values, e.op("Expand", e.const(np.full((1, 1), np.inf, x.dtype.numpy())),
                                              e.ints([groups, length - n])), axis=1)
    for length, run in launches(n, k):  # each doubling merges neighbouring sorted runs of `run` elements
        values, positions = e.op_multi("MergeRuns", values, positions, num_outputs=2, run=run, depth=length)
        if k < 2 * run < length:  # only a run's first k can reach the first k: keep them, halve the line
            values, positions = (_heads(e, v, groups, length // (2 * run), 2 * run, k) for v in (values, positions))
    back = [order.index(a) for a in range(rank)]
    results = []
    for sorted_line, negate in ((values, largest), (positions, False)):
        first = e.op("Slice", sorted_line, e.ints([0]), e.ints([k]), e.ints([1]))
        first = e.op("Neg", first) if negate else first
        first = e.reshape(first, moved[:-1] + [k])
        results.append(first if axis == rank - 1 else e.op("Transpose", first, perm=back))
    for old, new in zip(node.outputs, results):
        if old.uses() or old.is_graph_output():
            replace_output(old, new, "unsorted")
    graph.remove(node, safe=True)


class SortTopK(ContractPass):
    """Rewrite a TopK over a long line into a stable merge sort and a slice of its first k (in place)."""

    name = "sort_topk"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        found = [(n, s) for n in graph if (s := _sortable(n)) is not None]
        for node, (axis, k) in found:
            _sort(graph, node, axis, k)
        return ir.passes.PassResult(model, bool(found))
