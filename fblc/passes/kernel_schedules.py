"""KernelSchedules: each kernel group's schedule onto the step, and the saved masks it stores as r_mask4.

Rewrite: the anchor of every kernel group gets `fblc.schedule` (JSON: its kernels' schedules as
decided before lowering, by kernel name), and every saved mask whose writer's 2-D tile splits its
bytes between work-items gets the r_mask4 layout instead of its r_mask8 one. Before this pass the
code generator made that fallback while writing the kernel, rewriting `fblc.layout` from codegen, so
the memory plan ran twice (as a pass, then again for report.json) and the graph's `fblc.mem` could
disagree with the report. Now the fallback is on the graph before MemoryPlanPass, which runs once.

The decisions are the code generator's (fblc.codegen.kernels.schedules knows the kernels' tiles);
passes do not import codegen, so the caller hands them in (`fblc compile` does, see
fblc.codegen.plan.step_schedules). Without them the pass changes nothing: lower() then decides alone,
and the memory plan accounts such masks as r_mask8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import onnx_ir as ir

from fblc.compiler import keys
from fblc.passes.contracts import ContractPass


@dataclass(frozen=True)
class ScheduleDecisions:
    #: (a kernel group's anchor node, JSON of its group's schedules by kernel name)
    schedules: Sequence[tuple[ir.Node, str]] = ()
    #: saved mask value name -> its r_mask4 layout (TexelLayout JSON)
    layouts: Mapping[str, str] = field(default_factory=dict)


Decide = Callable[[ir.Model], ScheduleDecisions]


class KernelSchedules(ContractPass):
    """Record the kernels' schedules on their anchors and apply their r_mask4 fallbacks (in place)."""

    name = "kernel_schedules"
    requires_facts = ("kernels",)

    def __init__(self, decide: Decide | None = None) -> None:
        super().__init__()
        self.decide = decide

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.decide is None:
            return ir.passes.PassResult(model, False)
        decisions = self.decide(model)
        modified = False
        for node, text in decisions.schedules:
            if node.metadata_props.get(keys.SCHEDULE) != text:
                node.metadata_props[keys.SCHEDULE] = text
                modified = True
        values = list(model.graph.inputs) + [v for n in model.graph for v in n.outputs if v is not None]
        for value in values:
            layout = decisions.layouts.get(value.name)
            if layout is not None and value.metadata_props.get(keys.LAYOUT) != layout:
                value.metadata_props[keys.LAYOUT] = layout
                modified = True
        return ir.passes.PassResult(model, modified)


__all__ = ["Decide", "KernelSchedules", "ScheduleDecisions"]
