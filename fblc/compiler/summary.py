"""Human-readable summaries of a training-step graph (what trains, what is kept for the backward)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import numel
from fblc.compiler.keys import Role
from fblc.compiler.torch_names import display_name
from fblc.compiler.trainable import folded_torch_sources


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


#: a run of digits in a tensor name: layer indices, which group names (layers.0.q, layers.1.q -> layers.*.q)
_INDEX = re.compile(r"(?<=[._/])[0-9]+(?=[._/]|$)")
#: at most this many groups are printed; report.json and `fblc check` list every tensor
SHOWN_GROUPS = 12


@dataclass(frozen=True)
class TensorGroup:
    pattern: str  # the names with their layer indices replaced by '*'
    tensors: int
    values: int


def trained_tensors(graph: ir.Graph) -> list[ir.Value]:
    """The step's trained parameters, in graph input order."""
    return [v for v in graph.inputs if keys.get_role(v) == Role.PARAM.value]


def group_by_layer(values: list[ir.Value]) -> list[TensorGroup]:
    """Tensors whose names (torch names where the export recorded them) differ only in layer indices, as one
    group each, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for value in values:
        entry = groups.setdefault(_INDEX.sub("*", display_name(value)), [0, 0])
        entry[0] += 1
        entry[1] += numel(value.shape) if value.shape is not None and value.shape.is_static() else 0
    return [TensorGroup(pattern, t, n) for pattern, (t, n) in groups.items()]


def trained_set_source(graph: ir.Graph) -> str:
    """How the default trained set was chosen: from the exporter's records, or by a rule of thumb."""
    if any(keys.TORCH_INPUT_KIND in v.metadata_props for v in graph.initializers.values()):
        return "the exporter's parameter records"
    return "every float initializer but BatchNorm statistics (the ONNX file names no parameters)"


#: what neither source can tell, said where the trained tensors are listed
TRAINED_SET_CAVEAT = ("a torch parameter with requires_grad=False (a fixed positional table) is exported like any "
                      "other parameter: exclude such tensors with --freeze REGEX (matched against these names), or "
                      "choose the trained set with --train REGEX")


def trained_set_lines(graph: ir.Graph, shown: int | None = SHOWN_GROUPS) -> list[str]:
    """The trained tensors by layer group (the first `shown`, all for None), and how they were chosen,
    so that --freeze is an informed choice."""
    groups = group_by_layer(trained_tensors(graph))
    shown = len(groups) if shown is None else shown
    lines = [f"trained tensors, chosen by {trained_set_source(graph)}:"]
    for group in groups[:shown]:
        count = f"{group.tensors} tensors" if group.tensors > 1 else "1 tensor"
        lines.append(f"  {group.pattern}  ({count}, {group.values:,} values)")
    if len(groups) > shown:
        lines.append(f"  ... and {len(groups) - shown} more groups (`fblc check` lists all)")
    lines.append(f"  {TRAINED_SET_CAVEAT}")
    folded = folded_torch_sources(graph)
    if folded:
        sources = sorted({s for names in folded.values() for s in names})
        lines.append(f"not trained: onnxscript's optimizer folded {len(sources)} torch parameters into constants "
                     f"({', '.join(sources)}); they train only from an export with torch.onnx.export(..., "
                     "optimize=False)")
    return lines


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
        f"{stages.get('backward', 0)} backward, "
        + (f"{stages['es']} es (perturbations, rewards, estimate), " if stages.get("es") else "")
        + f"{stages.get('optimizer', 0)} optimizer; "
        f"saved for the backward: {len(saved)} tensors, {saved_elems:,} values",
    ]
    unused = model.metadata_props.get("fblc.unused_params")
    if unused:
        lines.append(f"not trained (the loss does not depend on them): {unused}")
    return "\n".join(lines + trained_set_lines(graph))
