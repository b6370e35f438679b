"""fura_s: FuRA-S, train the block singular values of the MatMul / Gemm weights, nothing else.

Selected by `--adapter fura-s [--block B] [--fura-sites REGEX]`; other adapters leave the model alone.
Without --block, B is the largest power of two <= 64 that divides the input features of every site
(fblc.compiler.fura_s.chosen_block), so every site is adapted.

Rewrite (the builders and the exact graph are in fblc.compiler.fura_s):
- every initializer that would train becomes `frozen`;
- at every site (a MatMul x @ W or Gemm with a constant float W; `--fura-sites` picks them by
  node or weight name, else every one whose input features B divides; a given B that does not
  divide a site's features skips it, with the reason in the metadata) the right singular vectors of W's
  blocks are computed here from the blocks' Gram matrices (fblc.compiler.fura_s.block_rights), W read a
  piece of at most weight_data.PIECE_BYTES at a time and dequantized piece by piece (host memory bounded
  by the piece and the [K, B, B] Grams, not the weight), and the site's input x becomes
  x + R (delta_k * (R^T x_k)) per block, R [K, B, r] a frozen initializer `<W>.fura_R`;
- one trainable vector `fura_s.delta` (zeros, all sites' K * r values in site order) feeds them.
At delta = 0 the model computes what it computed; at any delta, what the model with
W'_k = L_k diag(s_k (1 + delta_k)) R_k^T computes (under --weights fp16/int8/int4, R is stored rounded to
half (HALF_R): then W'_k to that rounding, 2^-11 of delta_k's share). Model metadata `fblc.fura_s` lists the sites,
their blocks, the block and where it came from (`block_from`) and the skipped sites with the reason;
the graph's `fblc.trained_by` says the block singular values are the trained set.

Preconditions: import passes ran (static shapes, constant weights); before mark_trainable.
In place; `modified` is false for any other adapter.
Errors: --block below 1, a --fura-sites pattern that matches nothing or a site the block does
not fit, a model without an eligible site, a given --block that fits no site (naming the sites'
input features).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.adapters import AdapterConfig, new_initializer
from fblc.compiler.fura_s import (DELTA, FuraSite, add_block_grams, block_rights, describe, emit_input_transform,
                                  find_fura_sites, select_sites, trained_by)
from fblc.compiler.graph import Emitter
from fblc.compiler.keys import Role
from fblc.compiler.quantize import WeightFormat, group_of, stored_values
from fblc.compiler.weight_data import MappedConstant, rows_per_piece
from fblc.passes.contracts import ContractPass


#: --weights under which R is stored in half (rounded at compile time; the ONNX step holds the same values): the
#: frozen weight's own rounding (fp16: 2^-11, int8/int4 groups: 1e-2 and more) is larger than R's (2^-11 of an
#: orthonormal column), and at delta = 0 the transform is the identity whatever R holds. Under fp32, R stays fp32.
HALF_R = ("fp16", "int8", "int4")


def stored_rights(site: FuraSite, block: int, weights: WeightFormat) -> np.ndarray:
    """R [K, b, r] of the blocks of the weight --weights stores (what quantize_weights leaves: dequantized, so that
    W'_k = L_k diag(s_k (1 + delta_k)) R_k^T holds for the weight the device computes with), read and dequantized a
    piece at a time, each piece's pages handed back before the next."""
    grams = np.zeros((site.n_in // block, block, block))
    with MappedConstant(site.weight.const_value) as mapped:  # type: ignore[arg-type]
        stored = mapped.array
        if site.transposed:  # stored [m, n]: rows of output features, each quantized whole along axis 1
            step, axis = rows_per_piece(stored), 1
        else:  # stored [n, m]: groups run down axis 0, so pieces of whole groups and whole blocks
            unit = math.lcm(block, group_of(site.n_in, weights.group))
            step, axis = max(unit, rows_per_piece(stored) // unit * unit), 0
        for start in range(0, stored.shape[0], step):
            piece = stored_values(stored[start:start + step], axis, weights)
            add_block_grams(grams, piece.T if site.transposed else piece, 0 if site.transposed else start)
            del piece
            mapped.drop()
    return block_rights(grams, min(site.m_out, block))


class FuraS(ContractPass):
    """Insert FuRA-S input transforms at every selected MatMul/Gemm and freeze the model (in place)."""

    name = "fura_s"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def __init__(self, config: AdapterConfig, weights: WeightFormat | None = None) -> None:
        super().__init__()
        self.config = config
        self.weights = weights or WeightFormat()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        config = self.config
        if config.kind != "fura-s":
            return ir.passes.PassResult(model, False)
        graph = model.graph
        selection = select_sites(find_fura_sites(graph), config.fura_sites, config.block)
        chosen = selection.sites
        for value in graph.initializers.values():
            if keys.get_role(value) == Role.PARAM.value:
                keys.set_role(value, Role.FROZEN)
        # the SVD of the weight the device computes with (--weights: dequantized, quantize_weights), so that
        # W'_k = L_k diag(s_k (1 + delta_k)) R_k^T holds for it
        block = selection.block
        ranks = [(site.n_in // block, min(site.m_out, block)) for site in chosen]
        total = sum(k * r for k, r in ranks)
        delta = new_initializer(graph, DELTA, np.zeros(total, np.float32), Role.PARAM)
        e = Emitter(graph, stage="forward")
        records, offset = [], 0
        for site, (blocks, rank) in zip(chosen, ranks):
            e.anchor, e.prefix = site.node, site.node.name
            name = f"{site.weight.name}.fura_R"
            if name in graph.initializers:  # a weight read by two sites (tied): one R per site
                name = f"{site.weight.name}.{site.node.name}.fura_R"
            right = stored_rights(site, block, self.weights)
            if self.weights.weights in HALF_R:
                right = right.astype(np.float16).astype(np.float32)
            right_value = new_initializer(graph, name, right, Role.FROZEN)
            if self.weights.weights in HALF_R:  # a half texture (storage_precision leaves a QUANTIZED constant's)
                right_value.metadata_props[keys.QUANTIZED], right_value.metadata_props[keys.STORAGE] = name, "fp16"
            right_t = e.op("Transpose", right_value, perm=[0, 2, 1])
            adapted = emit_input_transform(e, site, right_value, right_t, delta, offset)
            site.node.replace_input_with(0, adapted)
            records.append({"node": site.node.name, "weight": site.weight.name, "in": site.n_in, "out": site.m_out, "transposed": site.transposed,
                            "blocks": blocks, "rank": rank, "offset": offset, "values": blocks * rank, "right": name})
            offset += blocks * rank
        model.metadata_props[keys.FURA_S] = describe(selection, records, total)
        graph.metadata_props[keys.TRAINED_BY] = trained_by(len(records), selection.block)
        return ir.passes.PassResult(model, True)
