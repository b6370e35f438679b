"""index_ranges: record on each integer model input the table its values index, for the runtimes to check.

The gather kernels clamp an index into its table (an image read out of range is undefined on a
GPU), so a token id past the vocabulary trains silently on the last row where onnxruntime
refuses it. A negative index counts from the end, as in ONNX, in every gather kernel and in the
gradients' row sums (segment_sum.wrap_rows), so the ids that compute correctly are [-size, size).

Annotation: an integer graph input whose values reach an index operand (INDEX_OPERANDS) through
ops that move values without changing them (VALUE_KEEPING: Cast, Reshape, Slice, Concat...) gets
`keys.INDEX_TABLE`, a JSON list of bounds {"size", "axis", "table", "node"}: the tightest of the
tables it indexes (the fewest entries), the axis indexed, the table tensor's name and the indexing
node's. A GatherND / ScatterND tuple's entry j indexes axis j of its own: where the input reaches
the tuples with its last axis intact (through Identity and Cast alone) each entry gets its bound,
marked "position": j; through a reshape the entries are no longer known, and the values get the
loosest of the tuple's axes (a check that never refuses a valid id). The
bundle's manifest copies it to the input's entry. A path through arithmetic (ids + offset) is
not followed: the sum's range is not the input's. OneHot is no table: ONNX defines an index
outside its depth as an all-off row, and onnxruntime and the kernel both compute that.
Preconditions: static shapes. In place; the graph's nodes are unchanged (`modified` is false).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Callable

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.values import attr, static_shape
from fblc.passes.contracts import ContractPass


@dataclass(frozen=True)
class IndexedTable:
    size: int  # entries along the indexed axis
    axis: int
    table: str
    node: str
    position: int | None = None  # the entry of the index tuple's last axis it bounds (None: every value)


def _along_axis(node: ir.Node) -> list[IndexedTable]:
    """Gather, GatherElements, ScatterElements: every index picks an entry along `axis` of the data."""
    data = node.inputs[0]
    shape = static_shape(data)
    axis = int(attr(node, "axis", 0)) % max(len(shape), 1)
    return [IndexedTable(shape[axis], axis, data.name, node.name)]


def _tuples(first_axis: Callable[[ir.Node], int]) -> Callable[[ir.Node], list[IndexedTable]]:
    """GatherND, ScatterND: tuples [.., k] whose entry j indexes the data's axis first + j."""
    def tables(node: ir.Node) -> list[IndexedTable]:
        data, indices = node.inputs[0], node.inputs[1]
        shape, start = static_shape(data), first_axis(node)
        return [IndexedTable(shape[axis], axis, data.name, node.name, position=axis - start)
                for axis in range(start, start + static_shape(indices)[-1])]
    return tables


#: op type -> (the operand that holds indices, the tables its values index)
INDEX_OPERANDS: dict[str, tuple[int, Callable[[ir.Node], list[IndexedTable]]]] = {
    "Gather": (1, _along_axis),
    "GatherElements": (1, _along_axis),
    "ScatterElements": (1, _along_axis),
    "GatherND": (1, _tuples(lambda node: int(attr(node, "batch_dims", 0)))),
    "ScatterND": (1, _tuples(lambda node: 0)),
}

#: ops that keep every element where it was, so a tuple's entries stay on its last axis
POSITION_KEEPING = frozenset({"Identity", "Cast", "CastLike"})
#: op type -> the operands whose element values reach the outputs unchanged (None: all of them)
VALUE_KEEPING: dict[str, tuple[int, ...] | None] = {
    "Identity": None, "Cast": (0,), "CastLike": (0,), "Reshape": (0,), "Unsqueeze": (0,), "Squeeze": (0,),
    "Flatten": (0,), "Expand": (0,), "Tile": (0,), "Transpose": (0,), "Slice": (0,), "Split": (0,), "Concat": None,
    "Pad": (0,), "Gather": (0,), "GatherElements": (0,), "GatherND": (0,),
}  # not Where, Clip, Min, Max: a model may use them to replace the ids its tables do not hold


def _keeps_values(node: ir.Node, operand: int) -> bool:
    if node.domain not in ("", "ai.onnx") or node.op_type not in VALUE_KEEPING:
        return False
    kept = VALUE_KEEPING[node.op_type]
    # a Cast to bool keeps only zero or not
    return (kept is None or operand in kept) and all(out.dtype != ir.DataType.BOOL for out in node.outputs)


def indexed_tables(value: ir.Value) -> list[IndexedTable]:
    """Every table the element values of `value` index, through value-keeping ops."""
    found: list[IndexedTable] = []
    seen = {id(value)}
    pending = [(value, True)]  # (a value holding the input's ids, whether they are still where they were)
    while pending:
        current, in_place = pending.pop()
        for use in current.uses():
            node, operand = use.node, use.idx
            consumer = INDEX_OPERANDS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            if consumer is not None and operand == consumer[0]:
                tables = consumer[1](node)
                if not in_place and any(table.position is not None for table in tables):
                    tables = [replace(max(tables, key=lambda table: table.size), position=None)]
                found.extend(tables)
            if _keeps_values(node, operand):
                for out in node.outputs:
                    if id(out) not in seen:
                        seen.add(id(out))
                        pending.append((out, in_place and node.op_type in POSITION_KEEPING))
    return found


def tightest_bounds(tables: list[IndexedTable]) -> list[dict[str, object]]:
    """The fewest entries per position (None, every value, first), as the manifest records them."""
    tightest: dict[int | None, IndexedTable] = {}
    for table in tables:  # the first of equal sizes stays
        if table.position not in tightest or table.size < tightest[table.position].size:
            tightest[table.position] = table
    ordered = sorted(tightest.values(), key=lambda table: -1 if table.position is None else table.position)
    return [{k: v for k, v in asdict(table).items() if k != "position" or v is not None} for table in ordered]


class IndexRanges(ContractPass):
    """Annotate integer model inputs with the tightest table they index (in place, nodes unchanged)."""

    name = "index_ranges"
    requires_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        for value in graph.inputs:
            if value.name in graph.initializers or value.dtype is None or not value.dtype.is_integer():
                continue
            tables = indexed_tables(value)
            if tables:
                value.metadata_props[keys.INDEX_TABLE] = json.dumps(tightest_bounds(tables))
        return ir.passes.PassResult(model, False)
