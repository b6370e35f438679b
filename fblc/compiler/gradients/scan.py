"""Gradient rules of scans and selections: CumSum, Trilu, TopK.

- CumSum along an axis is y = L x with L the (strictly, when exclusive) lower-triangular ones
  matrix (upper when reverse); its adjoint L^T is the same scan in the other direction:
  dx = CumSum(dy, axis, exclusive, reverse = not reverse).
- Trilu keeps the elements on one side of diagonal k and zeroes the others, a constant mask:
  dx = Trilu(dy, k, upper) (the same mask).
- TopK's values are x read at its indices along `axis` (a GatherElements): dx scatters dy into
  zeros at the indices, ScatterElements with reduction "add" (the GatherElements gradient; the
  indices of one line are distinct, so nothing adds up, and torch.topk's backward does the same).
  The indices output carries no gradient.
"""

from __future__ import annotations

from typing import Sequence

import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.graph import Emitter, attr, static_shape

Grads = Sequence["ir.Value | None"]


@register_gradient("CumSum")
def cumsum_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    reverse = int(attr(node, "reverse", 0))
    dx = e.op("CumSum", dys[0], node.inputs[1], exclusive=int(attr(node, "exclusive", 0)), reverse=1 - reverse)
    return [dx, None]


@register_gradient("Trilu")
def trilu_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    k = node.inputs[1] if len(node.inputs) > 1 else None
    dx = e.op("Trilu", dys[0], *([k] if k is not None else []), upper=int(attr(node, "upper", 1)))
    return [dx] + [None] * (len(node.inputs) - 1)


@register_gradient("TopK")
def topk_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    x = node.inputs[0]
    if dys[0] is None:  # only the indices are read: no gradient reaches x
        return [None, None]
    shape = static_shape(x)
    axis = int(attr(node, "axis", -1)) % len(shape)
    dx = e.op("ScatterElements", e.zeros(shape, like=x), node.outputs[1], dys[0], axis=axis, reduction="add")
    return [dx, None]
