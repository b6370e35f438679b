"""The `layout` object of report.json: data movement before and after remapping, tiles and scores.

Read from the lowered step's annotations (tile_remap's `fblc.remap` and index maps, rtile_select's
`fblc.layout`) and the emitted kernels. A data-movement op is a copy kernel in the conventional
baseline; one kept (a remap check failed, or `--layout naive`) runs as a conversion kernel, which only
changes how a tensor is laid out.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import onnx_ir as ir

from fblc.codegen.plan import Program
from fblc.compiler import keys
from fblc.compiler.index_map import REMAPPABLE, is_view
from fblc.compiler.values import numel, static_shape
from fblc.passes.pipeline import TrainingOptions


def layout_object(model: ir.Model, program: Program, options: TrainingOptions) -> dict[str, Any]:
    graph = model.graph
    movement = [n for n in graph if n.op_type in REMAPPABLE and n.domain == ""]
    kept = [n for n in movement if not is_view(n)]
    before, after = Counter(n.op_type for n in movement), Counter(n.op_type for n in kept)
    stored = {t.name: t for t in program.textures}
    tensors = []
    for value in list(graph.inputs) + [v for n in graph for v in n.outputs if v is not None]:
        if value.name in stored and keys.LAYOUT in value.metadata_props:
            choice = keys.json_of(value.metadata_props, keys.LAYOUT_CHOICE, {})
            tensors.append({"name": value.name, "shape": list(static_shape(value)),
                            "layout": stored[value.name].layout.describe(), "chosen_by": choice.get("how", "flat"),
                            "score": choice.get("score"), "scored_by": choice.get("scored_by"),
                            "relaxed": choice.get("relaxed", []),
                            **{key: choice[key] for key in ("estimate_ms",) if key in choice}})
    kept_names = {n.name for n in kept}
    op_of = {n.name: n.op_type for n in graph}
    movers = [k for k in program.kernels if k.family == "movement"]
    search = {"search": options.layout_search} if options.layout == "rtile" else {}
    return {"mode": options.layout, **search, "data_movement_before": len(movement), "data_movement_after": len(kept),
            "conversion_kernels": sum(1 for k in program.kernels if kept_names.intersection(k.nodes)),
            "movement_kernels": len(movers),
            "movement_kernels_by_op": dict(Counter(op_of.get(k.nodes[0], "?") for k in movers if k.nodes)),
            "data_movement_by_op": {op: [before[op], after[op]] for op in sorted(before)},
            "kept": dict(Counter(n.metadata_props.get(keys.REMAP, "naive layout: every data-movement op is a copy")
                                 for n in kept)),
            "textures_by_layout": dict(Counter("rtile" if t.layout.kind == "rtile" else "flat"
                                               for t in program.textures)),
            "ftd_classes": dict(Counter(n.metadata_props.get(keys.FTD, "?") for n in graph)),
            "kernels_per_family": program.family_counts(), "tensors": tensors}


def layout_summary(layout: dict[str, Any], top: int = 12) -> str:
    """The readable version `fblc compile --report` prints."""
    search = f" (search {layout['search']})" if "search" in layout else ""
    lines = [f"layout {layout['mode']}{search}: data-movement ops {layout['data_movement_before']} before remapping, "
             f"{layout['data_movement_after']} after, {layout['conversion_kernels']} conversion kernels, "
             f"{layout['movement_kernels']} movement kernels ("
             + ", ".join(f"{count} {op}" for op, count in sorted(layout["movement_kernels_by_op"].items())) + ")",
             "  by op (before, after): " + ", ".join(f"{op} {b}->{a}" for op, (b, a) in
                                                    layout["data_movement_by_op"].items())]
    lines += [f"  kept {count}: {reason}" for reason, count in layout["kept"].items()]
    lines.append("  textures: " + ", ".join(f"{count} {kind}" for kind, count in layout["textures_by_layout"].items())
                 + "; FTD classes: " + ", ".join(f"{count} {c}" for c, count in sorted(layout["ftd_classes"].items())))
    lines.append("  kernels per family: " + ", ".join(f"{count} {family}" for family, count in
                                                      sorted(layout["kernels_per_family"].items())))
    tiled = sorted((t for t in layout["tensors"] if t["score"] is not None), key=lambda t: -numel(t["shape"]))
    if tiled:
        lines.append(f"  {'tensor':<44} {'shape':<18} {'score':>8}  layout (chosen by)")
        lines += [f"  {t['name'][:44]:<44} {str(t['shape']):<18} {t['score']:8.3f}  {t['layout']} "
                  f"({t['chosen_by']}{'; relaxed ' + ','.join(t['relaxed']) if t['relaxed'] else ''})"
                  for t in tiled[:top]]
        if len(tiled) > top:
            lines.append(f"  ... {len(tiled) - top} more scored tensors in report.json")
    return "\n".join(lines)
