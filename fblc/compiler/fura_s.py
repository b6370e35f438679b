"""Graph builders of FuRA-S: trainable block singular values of frozen MatMul / Gemm weights.

A weight W (out m x in n, as the paper writes it) is split into column blocks W_k of width b,
each with a thin SVD W_k = L_k diag(s_k) R_k^T (R_k: [b, r], r = min(m, b)). FuRA-S trains
delta_k with s'_k = s_k * (1 + delta_k), delta = 0 at the start. The update is a transform
of the layer's input, so W itself stays frozen (and may stay in any storage):

    W' x = sum_k W_k R_k diag(1 + delta_k) R_k^T x_k,   i.e.   x_k <- x_k + R_k (delta_k * (R_k^T x_k))

since W_k R_k R_k^T = W_k. A *site* is a MatMul x @ W or a Gemm x @ W (W [n, m], or [m, n]
with transB = 1: transformers' Linear, the legacy exporter's folded W^T, GPT-2's Conv1D)
whose W is a constant initializer. What a site's input becomes, x [..., n] with rows the
product of the leading axes and K = n / b blocks:

    xb   = Reshape(x, [rows, K, 1, b])                          each block a row vector
    c    = MatMul(xb, R) * Reshape(delta_site, [K, 1, r])       R [K, b, r], frozen: [rows, K, 1, r]
    x'   = x + Reshape(MatMul(c, Transpose(R)), x.shape)         [rows, K, 1, b], in x's own order

(the MatMuls broadcast R over the rows, so no transpose of the blocks and no copy back).

All sites read slices of one trainable vector `delta` (site order, K * r values each).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fblc import choices
from fblc.compiler import keys
from fblc.compiler.graph import Emitter, attr, static_shape
from fblc.compiler.keys import Role
from fblc.errors import FblcError

#: the trainable vector of every FuRA-S site
DELTA = "fura_s.delta"


@dataclass
class FuraSite:
    """A MatMul / Gemm reading constant weight `weight` at input `x` (the activation operand);
    `transposed`: the product reads W^T (W stored [out, in])."""

    node: ir.Node
    x: ir.Value
    weight: ir.Value
    n_in: int
    m_out: int
    transposed: bool

    def skip_reason(self, block: int) -> str | None:
        """Why blocks of width `block` do not fit this site, or None."""
        if block > self.n_in:
            return f"block {block} is wider than its {self.n_in} input features"
        if self.n_in % block:
            return f"block {block} does not divide its {self.n_in} input features"
        return None


def _stored_weight(operand: ir.Value) -> tuple[ir.Value, bool] | None:
    """(W, read transposed) when `operand` is a 2-D float `param` initializer or Transpose(perm 1, 0) of one
    (the dynamo exporter's Linear; fold_constants never folds through a parameter)."""
    transposed = False
    producer = operand.producer()
    if producer is not None and producer.op_type == "Transpose" and producer.domain == "" and \
            list(attr(producer, "perm", [1, 0])) == [1, 0]:
        operand, transposed = producer.inputs[0], True
    if operand is None or operand.const_value is None or keys.get_role(operand) != Role.PARAM.value:
        return None
    if len(static_shape(operand)) != 2 or not ir.DataType(operand.dtype).is_floating_point():
        return None
    return operand, transposed


def find_fura_sites(graph: ir.Graph) -> list[FuraSite]:
    """Every MatMul x @ W and Gemm (transA = 0) whose W is a constant float `param` (or its transpose)."""
    sites = []
    for node in graph:
        if node.domain != "" or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        x, operand = node.inputs[0], node.inputs[1]
        if x is None or operand is None or x.const_value is not None:
            continue
        if node.op_type == "Gemm" and int(attr(node, "transA", 0)):
            continue
        stored = _stored_weight(operand)
        if stored is None:
            continue
        weight, transposed = stored
        transposed ^= node.op_type == "Gemm" and bool(int(attr(node, "transB", 0)))
        shape = static_shape(weight)
        n_in, m_out = (shape[1], shape[0]) if transposed else (shape[0], shape[1])
        sites.append(FuraSite(node, x, weight, n_in, m_out, transposed))
    return sites


def add_block_grams(grams: np.ndarray, piece: np.ndarray, first_row: int) -> None:
    """grams[k] += W_k^T W_k for the blocks a piece of W covers: `piece` [c, h] is rows first_row .. first_row + c
    of W [n, m] (input features; both multiples of the block) over some h of its m output columns. Summed over
    pieces that cover every column once, grams[k] = W_k^T W_k [b, b] (W_k [m, b] as the module writes it):
    the pieces' products in float64, so a float32 W's Gram is exact to float64 rounding."""
    b, first = grams.shape[1], first_row // grams.shape[1]
    for i in range(piece.shape[0] // b):
        # a block at a time, cast in the order it lies in memory (a transposed weight's piece is a view: no
        # transposing copy), so that it stays in cache for the product, which numpy hands to BLAS's syrk (A A^T
        # of one buffer) whatever the order: the sums of the whole piece cast at once, bit for bit, 15 % sooner
        block = np.asarray(piece[i * b:(i + 1) * b], np.float64, order="K")
        grams[first + i] += block @ block.T


def block_rights(grams: np.ndarray, rank: int) -> np.ndarray:
    """R [K, b, r] of W's blocks from their Gram matrices W_k^T W_k = R_k diag(s_k^2) R_k^T: the eigenvectors of
    the r largest eigenvalues, in SVD's order (s descending), float32. Equal to numpy.linalg.svd's right vectors
    up to each column's sign (which x + R (delta (R^T x)) does not see) where the singular values are distinct;
    s_k's relative error is eps64 * (s_max / s_k)^2 (the Gram squares the condition number), R's columns err by
    eps64 * s_max^2 / (the gap to the next s_k^2)."""
    _, vectors = np.linalg.eigh(grams)  # ascending eigenvalues
    return np.ascontiguousarray(vectors[:, :, ::-1][:, :, :rank], np.float32)


def emit_input_transform(e: Emitter, site: FuraSite, right: ir.Value, right_t: ir.Value,
                         delta: ir.Value, offset: int) -> ir.Value:
    """x' (the module docstring) for `site`, reading delta[offset: offset + K * r]."""
    k, b, r = static_shape(right)
    shape = static_shape(site.x)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    blocks = e.reshape(site.x, [rows, k, 1, b])
    values = e.op("Slice", delta, e.ints([offset]), e.ints([offset + k * r]), e.ints([0]))
    scaled = e.op("Mul", e.op("MatMul", blocks, right), e.reshape(values, [k, 1, r]))
    return e.op("Add", site.x, e.reshape(e.op("MatMul", scaled, right_t), list(shape)))


#: without --block, the block is the largest power of two up to this that divides every site's input features
WIDEST_CHOSEN_BLOCK = choices.WIDEST_CHOSEN_BLOCK
CHOSEN_BLOCK_RULE = (f"chosen: the largest power of two <= {WIDEST_CHOSEN_BLOCK} that divides every adapted layer's "
                     "input features; --block sets it")


def chosen_block(sites: list[FuraSite]) -> int:
    """The block when --block is not given: the largest power of two <= WIDEST_CHOSEN_BLOCK that divides
    the input features of every site, so that no site is left out by default. A narrower block costs
    no trained values (a layer has K * min(m, b) = n of them while b <= m) and less compute
    (R is [K, b, r]); a layer of odd width makes it 1, each input feature's column scaled alone."""
    common = math.gcd(*(s.n_in for s in sites))
    return min(WIDEST_CHOSEN_BLOCK, common & -common)


@dataclass(frozen=True)
class FuraSelection:
    """The sites FuRA-S adapts, the block, where the block came from, and the sites left out with the reason."""

    sites: list[FuraSite]
    block: int
    block_from: str  # "--block", or CHOSEN_BLOCK_RULE
    skipped: list[dict[str, object]]


def _input_widths(sites: list[FuraSite]) -> str:
    """'6 (fc1), 8 (fc2, fc3)': the sites by input features, a few names each."""
    by_width: dict[int, list[str]] = {}
    for site in sites:
        by_width.setdefault(site.n_in, []).append(f"'{site.node.name}'")
    return ", ".join(f"{width} ({', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''})"
                     for width, names in sorted(by_width.items()))


def select_sites(sites: list[FuraSite], pattern: str | None, block: int | None) -> FuraSelection:
    """The sites that get FuRA-S. `pattern` (a regex over node and weight names) narrows the sites;
    `block` None chooses one that fits them all (chosen_block). A given block must fit every site the
    pattern matched; without a pattern, sites it does not fit are skipped, and none fitting is an error."""
    if pattern is not None:
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise FblcError(f"--fura-sites '{pattern}' is not a valid regular expression ({error})",
                            "use Python regex syntax, e.g. 'attn|mlp'") from None
        matched = [s for s in sites if compiled.search(s.node.name) or compiled.search(s.weight.name)]
        if not matched:
            examples = ", ".join(s.weight.name for s in sites[:5]) or "(none)"
            raise FblcError(f"--fura-sites '{pattern}' matches no MatMul/Gemm weight",
                            f"weights that can take FuRA-S: {examples}")
    else:
        matched = sites
    if not matched:
        raise FblcError("--adapter fura-s found no site: 0 MatMul/Gemm weight(s) with a constant float weight in the "
                        "model", "FuRA-S adapts MatMul/Gemm layers with constant weights; use another adapter for "
                        "this model")
    if block is None:
        return FuraSelection(matched, chosen_block(matched), CHOSEN_BLOCK_RULE, [])
    if pattern is not None:
        bad = [(s, s.skip_reason(block)) for s in matched if s.skip_reason(block)]
        if bad:
            site, reason = bad[0]
            raise FblcError(f"--block {block} does not fit site '{site.node.name}' (weight '{site.weight.name}'): "
                            f"{reason}", f"use a --block that divides {site.n_in}, e.g. "
                            f"{_divisor_hint(site.n_in, block)}, leave --block out (a block that fits every site "
                            "is chosen), or leave the site out of --fura-sites")
        return FuraSelection(matched, block, "--block", [])
    chosen = [s for s in matched if s.skip_reason(block) is None]
    if not chosen:
        raise FblcError(f"--adapter fura-s found no site for --block {block}: it divides the input features of no "
                        f"MatMul/Gemm layer (input features: {_input_widths(matched)})",
                        f"leave --block out (--block {chosen_block(matched)} fits every layer), or give a --block "
                        "that divides some layers' input features")
    skipped: list[dict[str, object]] = [
        {"node": s.node.name, "weight": s.weight.name, "in": s.n_in, "reason": str(s.skip_reason(block))}
        for s in matched if s.skip_reason(block) is not None]
    return FuraSelection(chosen, block, "--block", skipped)


def _divisor_hint(n: int, block: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return str(min(divisors, key=lambda d: (abs(d - block), d)))


def trained_by(layers: int, block: int) -> str:
    """What chose the trained set under FuRA-S (keys.TRAINED_BY)."""
    return f"--adapter fura-s: the block singular values of {layers} layer{'s' if layers != 1 else ''} (block {block})"


def describe(selection: FuraSelection, records: list[dict[str, object]], total: int) -> str:
    return json.dumps({"adapter": "fura-s", "block": selection.block, "block_from": selection.block_from,
                       "delta": DELTA, "trainable_params": total, "sites": records,
                       "skipped_sites": selection.skipped})
