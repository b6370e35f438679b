"""es_loop: the nodes of a loop's body (ES members in a loop) run together, between what they read and the rest.

Rewrite (fblc.compiler.es_loop.loop_phases): for a step whose graph inputs a loop carries (keys.LOOP_CARRIED,
written by es_gradients under `fblc compile`), the nodes are ordered, each phase keeping its order, as

    before: what the body reads that no carried value feeds   body: the member forward   after: the rest

and each is tagged keys.LOOP_PHASE, so fuse merges no kernel across two phases and numbers the body's kernels as
one range, which lowering writes as plan.json's loop (fblc.codegen.plan). The order stays topological: nothing
before or after the loop reads a value of its body (loop_phases checks), and the body reads only what runs
before it and the carried inputs. Graphs with no carried input are left alone (`modified` false).

Preconditions: topologically sorted; es_noise ran (the body's noise is made on the device). In place.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.es_loop import AFTER, BEFORE, BODY, loop_phases
from fblc.passes.contracts import ContractPass


class EsLoop(ContractPass):
    """Order the step's nodes before / body / after its loop and tag each with its phase (in place)."""

    name = "es_loop"
    requires_facts = ("static shapes",)
    ensures_facts = ("static shapes",)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        phases = loop_phases(graph)
        if not phases:
            return ir.passes.PassResult(model, False)
        nodes = list(graph)
        ordered = [n for phase in (BEFORE, BODY, AFTER) for n in nodes if phases[id(n)] == phase]
        graph.remove(nodes)
        graph.extend(ordered)
        for node in ordered:
            node.metadata_props[keys.LOOP_PHASE] = phases[id(node)]
        return ir.passes.PassResult(model, True)
