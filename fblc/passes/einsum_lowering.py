"""Einsum as Transpose, Reshape, MatMul, Mul and ReduceSum: the helper of lower_composites.

The equation is parsed into one list of labels per operand (a letter, or `...0`, `...1`, for
the dims an ellipsis stands for, right-aligned across operands as numpy broadcasts them). The
operands are then contracted left to right, two at a time. For a pair (A, B), every label is:

- batch: in A and B and still needed (in the output or a later operand);
- contracted: in A and B, not needed any more;
- left / right: in A only / B only, still needed;
- summed alone: in one operand only, not needed: ReduceSum over it first.

A is transposed to [batch, left, contracted] and B to [batch, contracted, right], reshaped to
[Bt, L, K] and [Bt, K, R] (2-D without batch labels), multiplied (MatMul; Mul of [Bt, L, 1] by
[Bt, 1, R] when nothing is contracted, an outer product) and reshaped to [batch, left, right].
A shared label of size 1 in one operand and n in the other is broadcast first (Expand).
The last operand is summed over the labels the output lacks and transposed to the output order.
Refused (UnsupportedOpError): a label repeated within one operand (a diagonal or trace), a
malformed equation. Every shape must be static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import onnx_ir as ir

from fblc.compiler.graph import Emitter, static_shape
from fblc.errors import UnsupportedOpError

_SUPPORTED = ("any number of operands; letters (upper or lower case), a leading, inner or trailing '...'; "
              "explicit '->' output or the implicit one; no label repeated within one operand")


@dataclass(frozen=True)
class Term:
    """One operand (or intermediate result) and the label of each of its axes."""

    value: ir.Value
    labels: tuple[str, ...]

    def sizes(self) -> dict[str, int]:
        return dict(zip(self.labels, static_shape(self.value)))


def _refuse(node: ir.Node, why: str) -> UnsupportedOpError:
    equation = _equation(node)
    return UnsupportedOpError(f"Einsum node '{node.name}' with equation '{equation}': {why}",
                              f"lower_composites lowers {_SUPPORTED}; rewrite the einsum in the model "
                              "(e.g. torch.diagonal for a diagonal) and export again", ops=["Einsum"])


def _equation(node: ir.Node) -> str:
    found = node.attributes.get("equation")
    text = "" if found is None else found.value
    return (text.decode() if isinstance(text, bytes) else str(text)).replace(" ", "")


def _expand_ellipsis(node: ir.Node, term: str, rank: int, ellipsis_rank: int) -> list[str]:
    """`term`'s labels, its ellipsis written out as the last dims of `...0` .. `...{E-1}`."""
    if term.count("...") > 1 or "." in term.replace("...", ""):
        raise _refuse(node, f"'{term}' has a malformed ellipsis")
    head, dots, tail = term.partition("...")
    if not all(c.isalpha() for c in head + tail):
        raise _refuse(node, f"'{term}' has a label that is not a letter")
    if not dots:
        if len(term) != rank:
            raise _refuse(node, f"'{term}' names {len(term)} axes of an operand of rank {rank}")
        return list(term)
    count = rank - len(head) - len(tail)
    if count < 0:
        raise _refuse(node, f"'{term}' names more axes than its operand's rank {rank}")
    return list(head) + [f"...{i}" for i in range(ellipsis_rank - count, ellipsis_rank)] + list(tail)


def parse(node: ir.Node, ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """The labels of every operand and of the output."""
    lhs, arrow, rhs = _equation(node).partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise _refuse(node, f"{len(terms)} operand terms for {len(ranks)} inputs")
    ellipsis_rank = max([rank - len(t.replace("...", "")) for t, rank in zip(terms, ranks) if "..." in t] or [0])
    inputs = [_expand_ellipsis(node, t, rank, ellipsis_rank) for t, rank in zip(terms, ranks)]
    for term, labels in zip(terms, inputs):
        if len(set(labels)) != len(labels):
            raise _refuse(node, f"a label repeats within '{term}' (a diagonal)")
    if arrow:
        out_rank = len(rhs.replace("...", "")) + (ellipsis_rank if "..." in rhs else 0)
        output = _expand_ellipsis(node, rhs, out_rank, ellipsis_rank)
    else:  # implicit: the ellipsis dims, then the letters used once, in alphabetical order
        letters = [label for labels in inputs for label in labels if not label.startswith("...")]
        output = [f"...{i}" for i in range(ellipsis_rank)] + sorted(c for c in set(letters) if letters.count(c) == 1)
    used = {label for labels in inputs for label in labels}
    if len(set(output)) != len(output) or not set(output) <= used:
        raise _refuse(node, "the output repeats a label or names one no operand has")
    return inputs, output


def _sum_out(e: Emitter, term: Term, drop: set[str]) -> Term:
    axes = [i for i, label in enumerate(term.labels) if label in drop]
    if not axes:
        return term
    return Term(e.reduce_sum(term.value, axes, keepdims=False), tuple(c for c in term.labels if c not in drop))


def _permute(e: Emitter, term: Term, order: Sequence[str]) -> Term:
    perm = [term.labels.index(label) for label in order]
    if perm == list(range(len(perm))):
        return term
    return Term(e.op("Transpose", term.value, perm=perm), tuple(order))


def _reshape(e: Emitter, value: ir.Value, shape: Sequence[int]) -> ir.Value:
    return value if list(static_shape(value)) == list(shape) else e.reshape(value, shape)


def _broadcast(e: Emitter, term: Term, sizes: dict[str, int]) -> Term:
    """Expand the axes of size 1 whose label is larger in the other operand."""
    shape = [sizes.get(label, n) if n == 1 else n for label, n in zip(term.labels, static_shape(term.value))]
    if shape == list(static_shape(term.value)):
        return term
    return Term(e.op("Expand", term.value, e.ints(shape)), term.labels)


def _check_sizes(node: ir.Node, a: Term, b: Term) -> dict[str, int]:
    """The size of every label of the pair; a shared label differs only by broadcasting a 1."""
    sizes = a.sizes()
    for label, n in b.sizes().items():
        have = sizes.get(label, n)
        if have != n and 1 not in (have, n):
            raise _refuse(node, f"label '{label}' has sizes {have} and {n}")
        sizes[label] = max(have, n)
    return sizes


def contract(e: Emitter, node: ir.Node, a: Term, b: Term, needed: set[str]) -> Term:
    """A and B contracted over their shared labels that are not `needed`, as [batch, left, right]."""
    a = _sum_out(e, a, {c for c in a.labels if c not in b.labels and c not in needed})
    b = _sum_out(e, b, {c for c in b.labels if c not in a.labels and c not in needed})
    sizes = _check_sizes(node, a, b)
    a, b = _broadcast(e, a, sizes), _broadcast(e, b, sizes)
    batch = [c for c in a.labels if c in b.labels and c in needed]
    summed = [c for c in a.labels if c in b.labels and c not in needed]
    left = [c for c in a.labels if c not in b.labels]
    right = [c for c in b.labels if c not in a.labels]
    a = _permute(e, a, batch + left + summed)
    b = _permute(e, b, batch + summed + right)
    count = [math.prod(sizes[c] for c in group) for group in (batch, left, summed, right)]
    lead = [count[0]] if batch else []
    if summed:
        product = e.op("MatMul", _reshape(e, a.value, lead + count[1:3]), _reshape(e, b.value, lead + count[2:4]))
    else:
        product = e.op("Mul", _reshape(e, a.value, lead + [count[1], 1]), _reshape(e, b.value, lead + [1, count[3]]))
    labels = batch + left + right
    return Term(_reshape(e, product, [sizes[c] for c in labels]), tuple(labels))


def lower_einsum(e: Emitter, node: ir.Node) -> ir.Value:
    """The Einsum node's result from primitive ops (module docstring)."""
    operands = list(node.inputs)
    inputs, output = parse(node, [len(static_shape(v)) for v in operands])
    terms = [Term(v, tuple(labels)) for v, labels in zip(operands, inputs)]
    while len(terms) > 1:
        needed = set(output).union(*(t.labels for t in terms[2:]))
        terms = [contract(e, node, terms[0], terms[1], needed)] + terms[2:]
    last = _sum_out(e, terms[0], set(terms[0].labels) - set(output))
    return _permute(e, last, output).value
