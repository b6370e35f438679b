"""sg_gradients: build_gradients for memflora-sg, which also keeps dL/dq of every adapter site.

Rewrite: as build_gradients (reverse-mode autodiff of `loss`, `P.grad` outputs for the
trainable parameters, forward values the backward reads get role `saved`), with the
bottleneck q of every MemFLoRA site (values marked `fblc.adapter.q` by memory_floor) among
the values differentiated: their gradients dL/dq are marked `fblc.adapter.dq` (the name of
their q) for sg_replay, which contracts them with the replayed site inputs. q itself is read by
no new backward op, so the saved set is that of memflora.
Preconditions: those of build_gradients; memory_floor ran with `--adapter memflora-sg`. In
place; `modified` as build_gradients.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler.autodiff import BackwardResult
from fblc.errors import FblcError
from fblc.compiler.graph import Emitter
from fblc.passes.build_gradients import BuildGradients
from fblc.compiler import keys


class SgGradients(BuildGradients):
    """Autodiff of the loss with respect to the parameters and every site's q (in place)."""

    name = "sg_gradients"

    def extra_targets(self, graph: ir.Graph) -> list[ir.Value]:
        bottlenecks = [v for n in graph for v in n.outputs if v is not None and keys.ADAPTER_SITE_Q in v.metadata_props]
        if not bottlenecks:
            raise FblcError("memflora-sg found no adapter bottleneck in the graph",
                            "run memory_floor with --adapter memflora-sg first")
        return bottlenecks

    def after_backward(self, extra: list[ir.Value], result: BackwardResult, naming: Emitter) -> None:
        for q in extra:
            dq = result.grads[q.name]
            if dq.producer() is None or keys.ADAPTER_SITE_DQ in dq.metadata_props:  # a zero, or shared: own it
                dq = naming.op("Identity", dq)
            dq.shape, dq.dtype = q.shape, q.dtype
            dq.metadata_props[keys.ADAPTER_SITE_DQ] = q.name
