"""Human-readable summaries of a training-step graph (what trains, what is kept for the backward)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import const_array, numel, static_shape
from fblc.compiler.keys import Role
from fblc.compiler.torch_names import display_name
from fblc.compiler.trainable import WEIGHT_SLOTS, folded_torch_sources


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
    """What chose the trained set: an adapter (its factors, FuRA-S's singular values: keys.TRAINED_BY), else
    the exporter's records or a rule of thumb; under the --train/--freeze patterns when given."""
    chooser = graph.metadata_props.get(keys.TRAINED_BY)
    if chooser is None and any(keys.TORCH_INPUT_KIND in v.metadata_props for v in graph.initializers.values()):
        chooser = "the exporter's parameter records"
    elif chooser is None:
        chooser = "every float initializer but BatchNorm statistics (the ONNX file names no parameters)"
    patterns = graph.metadata_props.get(keys.TRAINED_PATTERNS)
    return f"{patterns} over {chooser}" if patterns else chooser


#: what neither source can tell, said where the trained tensors are listed
TRAINED_SET_CAVEAT = ("a torch parameter with requires_grad=False (a fixed positional table) is exported like any "
                      "other parameter: exclude such tensors with --freeze REGEX (matched against these names), or "
                      "choose the trained set with --train REGEX")


#: ops that pass a tensor on, whole or in part, rearranged: what reads their output reads the tensor
_PASSED_ON = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Cast", "Slice", "Split",
                        "Expand"})
#: ops that pass every input on (the exporters build a recurrent layer's W and R as a Concat of the torch weights'
#: gate slices)
_PASSED_ON_EVERY_INPUT = frozenset({"Concat"})
#: op -> the input slots where a layer reads its weights (a Gather's table is judged by its indices)
_LAYER_WEIGHT_SLOTS = {op: slots for op, slots in WEIGHT_SLOTS.items() if op != "Gather"}


def _read_as_table(value: ir.Value) -> bool:
    """Whether the forward reads `value` other than as a layer's weight (through reshapes and slices) or as
    a table looked up at input-dependent ids (a token embedding): added to activations, or gathered at
    fixed positions, as a positional table is."""
    for use in value.uses():
        node = use.node
        if node.metadata_props.get(keys.STAGE, "forward") != "forward" or node.domain != "":
            continue  # the backward and the optimizer read every parameter
        if (node.op_type in _PASSED_ON and use.idx == 0) or node.op_type in _PASSED_ON_EVERY_INPUT:
            if any(_read_as_table(output) for output in node.outputs):
                return True
        elif node.op_type == "Gather" and use.idx == 0:
            if const_array(node.inputs[1]) is not None:
                return True
        elif node.op_type != "Einsum" and use.idx not in _LAYER_WEIGHT_SLOTS.get(node.op_type, ()):
            return True
    return False


def table_like_trained(graph: ir.Graph) -> list[str]:
    """The trained tensors TRAINED_SET_CAVEAT can be about: a table (two or more axes longer than 1; a
    bias, a scale or a cls token has one) that the forward reads as a table (_read_as_table). Neither
    exporter records requires_grad, so a fixed positional table trains unless it is frozen; an adapter's
    factors and every layer weight are read as weights, so the note is printed only where it can apply."""
    return [v.name for v in trained_tensors(graph)
            if v.shape is not None and v.shape.is_static() and sum(d > 1 for d in static_shape(v)) >= 2
            and _read_as_table(v)]


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
    tables = table_like_trained(graph)
    if tables:
        named = ", ".join(tables[:5]) + (f" and {len(tables) - 5} more" if len(tables) > 5 else "")
        lines.append(f"  note on {named} (read as a table, not as a layer's weight): {TRAINED_SET_CAVEAT}")
    folded = folded_torch_sources(graph)
    if folded:
        sources = sorted({s for names in folded.values() for s in names})
        lines.append(f"not trained: onnxscript's optimizer folded {len(sources)} torch parameters into constants "
                     f"({', '.join(sources)}); they train only from an export with torch.onnx.export(..., "
                     "optimize=False)")
    return lines


def adapter_report(model: ir.Model) -> dict[str, Any] | None:
    """report.json `adapter`: the sites the adapter took and those it skipped with the reason (None without one)."""
    if keys.ADAPTER in model.metadata_props:
        meta = keys.json_of(model.metadata_props, keys.ADAPTER)
        return {"adapter": meta["adapter"], "rank": meta["rank"], "unit": "site",
                "adapted": [site["conv"] for site in meta["sites"]], "skipped": meta.get("skipped", [])}
    if keys.FURA_S in model.metadata_props:
        meta = keys.json_of(model.metadata_props, keys.FURA_S)
        return {"adapter": meta["adapter"], "block": meta["block"], "block_from": meta.get("block_from", "--block"),
                "unit": "layer", "adapted": [site["node"] for site in meta["sites"]], "skipped": meta["skipped_sites"]}
    return None


#: at most this many adapted sites are named, and skipped ones listed, in the printed summary
SHOWN_SITES = 8


def skipped_site_label(site: dict[str, Any]) -> str:
    kind = {"conv": "conv ", "linear": "linear layer "}.get(site.get("kind", ""), "")
    weight = f" (weight '{site['weight']}')" if site.get("weight") else ""
    return f"{kind}'{site['node']}'{weight}"


def adapter_lines(adapter: dict[str, Any] | None) -> list[str]:
    """What the adapter adapted and what it skipped and why (adapter_report), for the compile and train-graph output."""
    if not adapter:
        return []
    if adapter["adapter"] == "fura-s":
        source = "given by --block" if adapter["block_from"] == "--block" else adapter["block_from"]
        head = f"adapter fura-s, block {adapter['block']} ({source})"
    else:
        head = f"adapter {adapter['adapter']}, rank {adapter['rank']}"
    adapted, skipped = adapter["adapted"], adapter["skipped"]
    unit = adapter["unit"] + ("s" if len(adapted) + len(skipped) != 1 else "")
    named = ", ".join(f"'{name}'" for name in adapted[:SHOWN_SITES]) + (
        f" and {len(adapted) - SHOWN_SITES} more" if len(adapted) > SHOWN_SITES else "")
    lines = [f"{head}: adapted {len(adapted)} of {len(adapted) + len(skipped)} {unit} ({named})"
             + (f"; skipped {len(skipped)}:" if skipped else "")]
    lines += [f"  {skipped_site_label(site)}: {site['reason']}" for site in skipped[:SHOWN_SITES]]
    if len(skipped) > SHOWN_SITES:
        lines.append(f"  ... and {len(skipped) - SHOWN_SITES} more (report.json 'adapter' lists every one)")
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
    unused = model.metadata_props.get(keys.UNUSED_PARAMS)
    if unused:
        lines.append(f"not trained (the loss does not depend on them): {unused}")
    if graph.metadata_props.get(keys.FORWARD_STEP) == "1":  # --trainer none: no trained set to list
        return "\n".join(lines + [f"a forward step: its outputs are the model's "
                                  f"({', '.join(repr(v.name) for v in graph.outputs)}); nothing trains"])
    return "\n".join(lines + adapter_lines(adapter_report(model)) + trained_set_lines(graph))
