"""Human-readable summaries of a training-step graph (what trains, what is kept for the backward)."""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import numel
from fblc.compiler.keys import Role


def role_counts(graph: ir.Graph) -> dict[str, tuple[int, int]]:
    """role -> (tensors, elements) over initializers and graph inputs."""
    seen: dict[int, ir.Value] = {id(v): v for v in list(graph.initializers.values()) + list(graph.inputs)}
    counts: dict[str, list[int]] = {}
    for value in seen.values():
        role = keys.get_role(value)
        if role is None:  # constants made by folding or by the emitter
            continue
        entry = counts.setdefault(role, [0, 0])
        entry[0] += 1
        entry[1] += numel(value.shape) if value.shape is not None and value.shape.is_static() else 0
    return {role: (t, e) for role, (t, e) in counts.items()}


def summarize_step(model: ir.Model) -> str:
    graph = model.graph
    counts = role_counts(graph)
    trained, trained_elems = counts.get(Role.PARAM.value, (0, 0))
    frozen, frozen_elems = counts.get(Role.FROZEN.value, (0, 0))
    states, state_elems = counts.get(Role.OPT_STATE.value, (0, 0))
    stages = Counter(n.metadata_props.get(keys.STAGE, "forward") for n in graph)
    saved = [v for n in graph for v in n.outputs if keys.get_role(v) == Role.SAVED.value]
    saved_elems = sum(numel(v.shape) for v in saved if v.shape is not None)
    lines = [
        f"trainable: {trained} tensors, {trained_elems:,} parameters; frozen: {frozen} tensors, "
        f"{frozen_elems:,} values; optimizer state: {states} tensors, {state_elems:,} values",
        f"nodes: {stages.get('forward', 0)} forward, {stages.get('loss', 0)} loss, "
        f"{stages.get('backward', 0)} backward, {stages.get('optimizer', 0)} optimizer; "
        f"saved for the backward: {len(saved)} tensors, {saved_elems:,} values",
    ]
    unused = model.metadata_props.get("fblc.unused_params")
    if unused:
        lines.append(f"not trained (the loss does not depend on them): {unused}")
    return "\n".join(lines)
