"""tie_weights: train a tied weight once, when the exporter wrote it as several initializers.

A model that ties its output projection to its input embedding (GPT-2, OPT, BLOOM, T5, Gemma)
has one torch parameter W. The legacy exporter's constant folding, and onnxscript's optimizer,
write the MatMul's operand as a second initializer W^T (named like `onnx::MatMul_213`), and may
write exact copies. Trained as separate tensors, each copy gets part of W's gradient and they
drift apart: the step is wrong. Rewrite: among `param` initializers, one that equals another's
transpose (2-D) or another exactly (same shape) is replaced by `Transpose(W)` or by `W` itself,
so W gets the summed gradient and one update. W is the one with the exporter's parameter name
(not `onnx::...`, no onnxscript `folded_from` record), else the first in file order.

Equality is checked bit for bit; constant-valued tensors (all elements equal, such as a fresh
bias) never tie, since two of them can be equal by coincidence. Preconditions:
classify_initializers ran. In place.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.weight_data import equal_data, fingerprint, value_range
from fblc.passes.contracts import ContractPass


def _is_generated(value: ir.Value) -> bool:
    name = value.name or ""
    return "::" in name or keys.ONNXSCRIPT_FOLDED_FROM in value.metadata_props


def _shape_key(tensor: ir.TensorProtocol) -> tuple[object, ...] | None:
    """A key equal for a tensor and its transpose, from its shape and type alone; None for tensors that never
    tie (neither a vector nor a matrix, a single element, not floating point)."""
    shape = tuple(tensor.shape.numpy())
    if len(shape) not in (1, 2) or int(np.prod(shape)) < 2 or not tensor.dtype.is_floating_point():
        return None
    return (tuple(sorted(shape)), tensor.dtype)


def _not_constant(tensor: ir.TensorProtocol) -> bool:
    """False for a constant-valued tensor (or one with a NaN), which never ties: two can be equal by coincidence."""
    low, high = value_range(tensor)
    return low < high


def _buckets(candidates: list[tuple[ir.Value, ir.TensorProtocol]]) -> list[list[tuple[ir.Value, ir.TensorProtocol]]]:
    """Groups of tensors that may be equal (plain or transposed), each of two or more, none constant-valued.

    Narrowed in steps that read ever more: by shape, then by a fingerprint of a few elements, then by the
    values' range (a whole read, piece by piece: weight_data), so that a model without ties reads almost
    nothing of its weights."""
    groups: list[list[tuple[ir.Value, ir.TensorProtocol]]] = [candidates]
    for key in (_shape_key, fingerprint):
        split: list[list[tuple[ir.Value, ir.TensorProtocol]]] = []
        for group in groups:
            keyed: dict[object, list[tuple[ir.Value, ir.TensorProtocol]]] = defaultdict(list)
            for member in group:
                found = key(member[1])
                if found is not None:
                    keyed[found].append(member)
            split.extend(g for g in keyed.values() if len(g) > 1)
        groups = split
    narrowed = [[member for member in group if _not_constant(member[1])] for group in groups]
    return [group for group in narrowed if len(group) > 1]


def _relation(canonical: ir.TensorProtocol, other: ir.TensorProtocol) -> str | None:
    """'same' or 'transposed' when `other` is `canonical` bit for bit, plain or transposed."""
    if tuple(other.shape) == tuple(canonical.shape) and equal_data(canonical, other, transposed=False):
        return "same"
    if len(other.shape) == 2 and tuple(other.shape) == tuple(canonical.shape)[::-1] \
            and equal_data(canonical, other, transposed=True):
        return "transposed"
    return None


class TieWeights(ContractPass):
    """Replace copies and transposed copies of a parameter by reads of it (in place)."""

    name = "tie_weights"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        candidates = [(value, value.const_value) for value in graph.initializers.values()
                      if keys.get_role(value) == Role.PARAM.value and value.const_value is not None
                      and not value.is_graph_output() and not value.is_graph_input()]  # inputs, outputs: named
        modified = False
        for members in _buckets(candidates):
            members.sort(key=lambda member: _is_generated(member[0]))  # stable: named ones first
            remaining = list(members)
            while remaining:
                canonical, array = remaining.pop(0)
                kept = []
                for other, other_array in remaining:
                    relation = _relation(array, other_array)
                    if relation is None:
                        kept.append((other, other_array))
                        continue
                    self._tie(graph, canonical, other, relation)
                    modified = True
                remaining = kept
        return ir.passes.PassResult(model, modified)

    @staticmethod
    def _tie(graph: ir.Graph, canonical: ir.Value, copy: ir.Value, relation: str) -> None:
        replacement = canonical
        if relation == "transposed":
            node = ir.node("Transpose", [canonical], {"perm": [1, 0]}, name=f"tie_weights/{copy.name}")
            replacement = node.outputs[0]
            replacement.name = f"{copy.name}/tied"
            replacement.shape, replacement.type = copy.shape, copy.type
            first = next(iter(graph), None)
            if first is None:
                graph.append(node)
            else:
                graph.insert_before(first, node)
        ir.convenience.replace_all_uses_with(copy, replacement)
        del graph.initializers[copy.name]
