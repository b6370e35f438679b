"""Gaps: every node a table (gradient rules, shape rules, kernel emitters) lacks, in one error line.

A user who tries a model wants to see everything fblc cannot do with it at once, not one op
per attempt. The checks gather the nodes first (`OpRegistry.missing`, or a pre-pass over the
graph), group them by op, and say so in one `UnsupportedOpError`:

    3 ops have no gradient rule: Einsum (2 nodes: 'e1', 'e2'), TopK (1 node: 'topk'), ...

Node lists are cut after `NODES_SHOWN` names, so the `fblc: error:` line of a model with
hundreds of such nodes stays readable. An op is never cut: naming every one is the point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import onnx_ir as ir

from fblc.errors import FblcError, UnsupportedOpError

NODES_SHOWN = 3
DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class OpGap:
    """One op type a table lacks, with the nodes that need the missing entry."""

    op: str  # the op type, prefixed by its domain when that is not the default one
    nodes: tuple[str, ...]


def op_label(node: ir.Node) -> str:
    """`Einsum`, or `com.microsoft.FusedGelu` for another domain (that op is not the ONNX one)."""
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"


def node_label(node: ir.Node) -> str:
    return node.name or f"<unnamed {node.op_type}>"


def group_by_op(nodes: Iterable[ir.Node]) -> list[OpGap]:
    """The nodes grouped by op, ops in the order of their first node (the graph's order)."""
    found: dict[str, list[str]] = {}
    for node in nodes:  # each node once (unnamed nodes share a label, so labels are not deduplicated)
        found.setdefault(op_label(node), []).append(node_label(node))
    return [OpGap(op, tuple(names)) for op, names in found.items()]


def describe_nodes(names: Sequence[str], counted: bool = True) -> str:
    """`1 node: 'a'`, `5 nodes: 'a', 'b', 'c' and 2 more`; `node 'a'` with counted=False and one node."""
    if len(names) == 1 and not counted:
        return f"node '{names[0]}'"
    shown = ", ".join(f"'{n}'" for n in names[:NODES_SHOWN])
    more = f" and {len(names) - NODES_SHOWN} more" if len(names) > NODES_SHOWN else ""
    return f"{len(names)} node{'s' if len(names) != 1 else ''}: {shown}{more}"


def describe_gaps(what: str, gaps: Sequence[OpGap]) -> str:
    """One op keeps the wording of a single lookup (`no gradient rule for op Cosh (node 'c')`)."""
    if len(gaps) == 1:
        return f"no {what} for op {gaps[0].op} ({describe_nodes(gaps[0].nodes, counted=False)})"
    listed = ", ".join(f"{g.op} ({describe_nodes(g.nodes)})" for g in gaps)
    return f"{len(gaps)} ops have no {what}: {listed}"


def combined_error(what: str, remedy: str, supported: Sequence[str], gaps: Sequence[OpGap],
                   refusals: Sequence[FblcError] = ()) -> FblcError:
    """One error for the ops a table lacks and the nodes whose entry refused them (an attribute it
    does not handle, e.g. AveragePool with ceil_mode); a lone refusal is returned as it is."""
    if not gaps and len(refusals) == 1:
        return refusals[0]
    ops = [g.op for g in gaps] + [op for r in refusals for op in getattr(r, "ops", ())]
    causes = ([describe_gaps(what, gaps)] if gaps else []) + [r.cause for r in refusals]
    remedies = [remedy] if gaps else []
    for refusal in refusals:  # each refusal's own advice, once
        if refusal.remedy and refusal.remedy not in remedies:
            remedies.append(refusal.remedy)
    if gaps:
        remedies.append(f"supported ops: {', '.join(supported)}")
    return UnsupportedOpError("; ".join(causes), "; ".join(remedies), ops=ops)


def mark_refusal(refusal: UnsupportedOpError, node: ir.Node) -> UnsupportedOpError:
    """`refusal` (raised by a rule or emitter about `node`) with `node`'s op in its `ops`."""
    if not refusal.ops:
        refusal.ops = (op_label(node),)
    return refusal
