"""Gradient rules of the scatters: ScatterND and ScatterElements, reduction "none" and "add".

y = Scatter(data, indices, updates) writes (or adds) each update at the position its index names
and copies data everywhere else. With dy the gradient of y:

- reduction "add": y = data + (updates summed into their positions), linear in both, so
  d_data = dy and d_updates = dy read at each update's position (GatherND / GatherElements).
- reduction "none": a written position forgets data, so d_data = dy with every written position
  zeroed, computed as the same scatter of zeros into dy (Scatter(dy, indices, 0)); d_updates = dy
  read at each update's position, as for "add".

Duplicate indices with reduction "none" (ONNX leaves the winner undefined): every update that
names a position gets that position's whole dy, and data gets none of it there. This is what
PyTorch's autograd does for the ops that export as these scatters: index_put_ (x[idx] = y,
accumulate=False) and slice assignment backpropagate grad.index(indices) to the values and
grad.index_put(indices, 0) to self; torch.scatter gives src grad.gather(dim, index) and self
grad.scatter(dim, index, 0). Both gradients are deterministic and race-free at any thread count:
a gather reads, and the scatter of zeros writes the same value wherever writes collide. No
segment sum is needed: nothing adds up in the backward of a scatter (it is the gathers' job).

Negative indices count from the end in every op involved (ONNX's ScatterND, ScatterElements,
GatherND and GatherElements all accept them), so the rules pass the forward's indices through.
ScatterND's tuples may be partial ([.., k] with k below the data's rank): each update is then a
slice data[i_0, .., i_{k-1}, ...], and GatherND with the same tuples reads the same slices.

Reductions "mul", "max" and "min" are refused by name: their gradients depend on which update won
(or on the product of the others), which these rules do not compute.
"""

from __future__ import annotations

from typing import Callable, Sequence

import onnx_ir as ir

from fblc.compiler.autodiff import register_gradient
from fblc.compiler.graph import Emitter, attr, static_shape
from fblc.errors import UnsupportedOpError

Grads = Sequence["ir.Value | None"]

DataGradient = Callable[[Emitter, ir.Node, ir.Value, dict[str, int]], ir.Value]


def _written_zeroed(e: Emitter, node: ir.Node, dy: ir.Value, axis: dict[str, int]) -> ir.Value:
    """Reduction "none": dy with the written positions zeroed, the same scatter of zeros into dy."""
    zeros = e.zeros(static_shape(node.inputs[2]), like=dy)
    return e.op(node.op_type, dy, node.inputs[1], zeros, **axis)


#: reduction -> the data's gradient (the reductions these rules differentiate)
DATA_GRADIENTS: dict[str, DataGradient] = {"none": _written_zeroed, "add": lambda e, node, dy, axis: dy}

#: scatter op -> the gather that reads what it wrote (the updates' gradient)
GATHERS = {"ScatterND": "GatherND", "ScatterElements": "GatherElements"}


def _reduction(node: ir.Node) -> str:
    value = attr(node, "reduction", "none")
    reduction = value.decode() if isinstance(value, bytes) else str(value)
    if reduction not in DATA_GRADIENTS:
        raise UnsupportedOpError(
            f"{node.op_type} node '{node.name}' with reduction '{reduction}' has no gradient rule "
            f"(supported: reduction {' and '.join(DATA_GRADIENTS)})",
            "freeze what feeds its data and updates, or write the model with a plain or additive scatter",
            ops=[node.op_type])
    return reduction


@register_gradient("ScatterND", "ScatterElements")
def scatter_grad(e: Emitter, node: ir.Node, dys: Grads, need: Sequence[bool]) -> Grads:
    data, indices = node.inputs[:2]
    reduction = _reduction(node)
    dy = dys[0]
    assert dy is not None, "a scatter has one output, and the rule runs only when it has a gradient"
    rank = len(static_shape(data))
    axis = {"axis": int(attr(node, "axis", 0)) % rank} if node.op_type == "ScatterElements" else {}
    d_data = DATA_GRADIENTS[reduction](e, node, dy, axis) if need[0] else None
    d_updates = e.op(GATHERS[node.op_type], dy, indices, **axis) if need[2] else None
    return [d_data, None, d_updates]
