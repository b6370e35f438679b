"""infer_shapes: give every value a static shape and dtype.

Rewrite: value shapes and dtypes are (re)computed by onnx's shape inference; the nodes are left
alone, but for the ceil_mode of pools where it makes no difference (below). Preconditions:
static graph input shapes. In place; `modified` is true when a shape, a dtype or a ceil_mode
changed; fails naming every value whose shape stays unknown.

ceil_mode pools: onnx's inference (1.23) keeps a last window that starts in the end padding,
where onnxruntime and torch drop it (`fblc.compiler.shape_rules.pool_output_size`), so its
shape is one too long there, and so is everything computed from it. onnxruntime's session runs
the same inference, so the step ONNX would not even load. Whenever that happens, no window runs
past the padded input (a window can only start in the end padding when the kernel is shorter
than stride + end pad, and then the one before it ends inside the padding), so ceil_mode=0
gives the same result for MaxPool and both AveragePool divisors: the pass sets it. A ceil_mode
that does add a partial window stays; onnx's shape is right for it, and the kernels and the
AveragePool gradient handle the window's overhang. Pool input shapes come from the model (the
exporter's value_info, the folder's inference) or from a first inference round; the shapes
below a ceil_mode pool are forgotten and inferred again, since an exporter's (right) shape would
make strict inference fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fblc.compiler.shape_rules import pool_output_size
from fblc.compiler.shapes import infer_shapes
from fblc.compiler.values import attr
from fblc.passes.contracts import ContractPass

_POOLS = ("AveragePool", "MaxPool")


@dataclass
class _CeilPool:
    """A ceil_mode pool with explicit pads (auto_pad ignores ceil_mode for SAME and VALID)."""

    node: ir.Node
    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    pads: list[int]

    @classmethod
    def of(cls, node: ir.Node) -> _CeilPool | None:
        auto_pad = attr(node, "auto_pad", "NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if node.op_type not in _POOLS or node.domain not in ("", "ai.onnx") or not int(attr(node, "ceil_mode", 0)) \
                or auto_pad != "NOTSET":
            return None
        kernel = [int(k) for k in attr(node, "kernel_shape")]
        rank = len(kernel)
        return cls(node, kernel, [int(s) for s in attr(node, "strides") or [1] * rank],
                   [int(d) for d in attr(node, "dilations") or [1] * rank],
                   [int(p) for p in attr(node, "pads") or [0] * (2 * rank)])

    def settle(self) -> bool:
        """ceil_mode=0 when, for the input's current shape, it gives the same output length on every
        axis, else 1 (a decision from a stale shape is taken back); True when the attribute changed."""
        x = self.node.inputs[0]
        if x is None or x.shape is None or not x.shape.is_static():
            return False
        rank = len(self.kernel)
        spatial = [int(d) for d in x.shape][2:]
        lengths = {ceil: [pool_output_size(n, self.kernel[i], self.strides[i], self.dilations[i], self.pads[i],
                                           self.pads[i + rank], ceil) for i, n in enumerate(spatial)]
                   for ceil in (False, True)}
        ceil_mode = int(lengths[False] != lengths[True])
        if int(attr(self.node, "ceil_mode", 0)) == ceil_mode:
            return False
        self.node.attributes["ceil_mode"] = ir.AttrInt64("ceil_mode", ceil_mode)
        return True


def _forget_below(nodes: list[ir.Node]) -> None:
    """Drop the shapes of `nodes`' outputs and of every value computed from them (inferred again)."""
    stack = [out for node in nodes for out in node.outputs]
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        value.shape = None
        for use in value.uses():
            stack.extend(use.node.outputs)


def _signature(model: ir.Model) -> list[tuple[object, object]]:
    return [(None if v.shape is None else tuple(v.shape), v.dtype) for node in model.graph for v in node.outputs]


class InferShapes(ContractPass):
    """Static shape and dtype inference (in place)."""

    name = "infer_shapes"
    requires_facts = ("static inputs",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        pools = [p for p in map(_CeilPool.of, model.graph) if p is not None]
        if not pools:
            return ir.passes.PassResult(model, infer_shapes(model))
        before = _signature(model)
        for pool in pools:  # from the model's own shapes, mostly right: the first round then infers the rest
            pool.settle()
        _forget_below([p.node for p in pools])
        # A round settles at least the first pool whose input shape was still unknown or wrong.
        for _ in range(len(pools)):
            infer_shapes(model, require_static=False)
            changed = [p.node for p in pools if p.settle()]
            if not changed:
                break
            _forget_below(changed)
        infer_shapes(model)
        dropped = any(int(attr(p.node, "ceil_mode", 0)) == 0 for p in pools)
        return ir.passes.PassResult(model, dropped or _signature(model) != before)
