"""report.json's `estimate`, `memory` and `layout` objects and their readable summaries (docs/ARCHITECTURE.md §3).

`estimate` is the target profile's roofline, not a measurement: reads count every texture once (a perfect texture
cache) unless `--cache-report`'s simulated misses replace them; `benchmarks/estimate_check.py` compares its
ranking of kernels with per-kernel times measured on the local device. `memory` (and the timeline plot) joins the
step's memory plan (fblc.passes.memory_plan) and the buffer table (plan.buffer_table): `device_peak`, what the
runtimes allocate on the target in the storage they use there (`device_storage`: buffers on a CPU, else images):
`arena_bytes`, one buffer that every texture is a view of, in buffers, or in images where the target has
cl_khr_image2d_from_buffer and the arena is the smaller (`arena_images`); else `shared_image_bytes`, the images
that textures of one format and width share; `arena_live_bytes` is
the most arena bytes live at one launch; `texture_bytes`, every texture in an image of its own; `live_peak`, the
planner's lower bound. `layout` is read from the step's annotations (tile_remap's `fblc.remap` and index maps, rtile_select's
`fblc.layout`): a data-movement op kept (a remap check failed, or `--layout naive`) runs as a conversion kernel,
which only changes how a tensor is laid out; the conventional baseline would copy every one.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from fblc.bundle_format import FLOAT_FORMATS, INTEGER_FORMATS
from fblc.codegen.plan import BufferTable, Program, kernel_groups
from fblc.compiler import keys
from fblc.compiler.flops import node_flops
from fblc.compiler.index_map import REMAPPABLE, is_view
from fblc.compiler.values import numel, static_shape
from fblc.passes.memory_plan import MemoryPlan
from fblc.passes.pipeline import TrainingOptions
from fblc.profiles import Profile
from fblc.profiles.roofline import LaunchWork, launch_time


def estimate_object(model: ir.Model, program: Program, profile: Profile,
                    cache: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """report.json's `estimate`: each launch's time in a step (a loop's launches: all `repeats`) by the profile's
    roofline (fblc.profiles.roofline: occupancy,
    half rate, texture and DRAM bytes, launch cost) from what the compiler knows of its work without reading
    its kernel: its nodes' FLOPs, as fused multiply-adds (in half where every float texture it writes is half
    and the target computes in half), each texture it reads fetched once, whole texels, and the bytes it
    writes. A lower bound of the kernel-IR estimate (fblc/tools/kernel_stats.py ir_estimate: every fetch and
    lane-operation the kernel runs); counting those here would double a compile's time."""
    # by the fuse pass's kernel id (k12): a group's kernels are named k12_Op, k12_Op_stats...
    group_flops = {g.name.split("_", 1)[0]: sum(node_flops(n) for n in g.nodes) for g in kernel_groups(model.graph)}
    misses = {k["kernel"]: k["misses"] for k in cache["kernels"]} if cache else {}
    block_texels = profile.tex_block_width * profile.tex_block_height
    kernels, total = [], 0.0
    for index, kernel in enumerate(program.kernels):
        # counted once, at the group's first kernel (each part's, of a co-launched one: codegen/co_launch.py)
        parts = [part.name for part in kernel.parts] or [kernel.name]
        flops = sum(group_flops.pop(name.split("_", 1)[0], 0) for name in parts)
        written = sum(program.textures[t].image_bytes for t in kernel.outputs)
        read = sum(program.textures[t].image_bytes for t in set(kernel.inputs))
        if kernel.name in misses:  # simulated misses of the traced kernel: whole blocks of 16-byte texels
            read = misses[kernel.name] * block_texels * 16
        formats = {program.textures[t].format for t in kernel.outputs} - set(INTEGER_FORMATS)
        half = profile.fp16 and formats == {FLOAT_FORMATS["fp16"]}
        launched, group = kernel.launch(profile)
        slots = flops / 2  # every flop in a fused multiply-add: the fewest issue slots its nodes take
        time = launch_time(profile, LaunchWork(kernel.global_size, launched, group, 0 if half else slots,
                                               slots if half else 0, read, read + written))
        repeats = program.repetitions(index)  # a loop's launches (ES members) run once per repetition
        kernels.append({"kernel": kernel.name, "family": kernel.family, "flops": flops * repeats,
                        "bytes": (read + written) * repeats, "ms": round(time.ms * repeats, 6), "bound": time.bound,
                        "lanes": round(time.lane_share, 4), "half": half,
                        **({"repeats": repeats} if repeats > 1 else {})})
        total += time.ms * repeats
    return {"kind": "estimate from the target profile (fblc.profiles.roofline: peak_gflops at the lanes a launch "
                    "occupies, half_rate, texture_bytes_per_clock, bandwidth_gbps, launch_us), not measured; "
                    "work: the nodes' FLOPs, each texture read once",
            "profile": profile.name, "reads": "simulated cache misses" if misses else "each texture once",
            "step_ms": round(total, 4), "flops": sum(k["flops"] for k in kernels),
            "bytes": sum(k["bytes"] for k in kernels), "kernels": kernels}


def estimate_summary(estimate: Mapping[str, Any], top: int = 6) -> str:
    """The readable version `fblc compile --report` prints."""
    bounds = Counter(k["bound"] for k in estimate["kernels"])
    lines = [f"estimate for {estimate['profile']} (from its profile, not measured): {estimate['step_ms']:.3f} ms per "
             f"step, {estimate['flops'] / 1e9:.3f} GFLOP, {estimate['bytes'] / 1e6:.1f} MB moved; kernels bound by "
             + ", ".join(f"{kind} {count}" for kind, count in sorted(bounds.items()))]
    return "\n".join(lines + [f"  {k['kernel'][:32]:<32} {k['family']:<12} {k['ms']:9.4f} ms  {k['bound']}"
                              for k in sorted(estimate["kernels"], key=lambda k: -k["ms"])[:top]])


TIMELINE_PLOT = "memory_timeline.png"
INTEGER_FIELDS = ("weights", "grads", "optimizer", "saved", "buffers", "training_state_peak", "live_peak")
#: stacking order and colours of the plot (bottom to top)
LAYERS = (("weight", "weights", "#8c8c8c"), ("optimizer", "optimizer state", "#b07aa1"),
          ("input", "inputs", "#9c755f"), ("grad", "gradients", "#59a14f"), ("saved", "saved activations", "#e15759"),
          ("mask", "saved bit masks", "#ff9da7"), ("replay", "replay buffers", "#edc948"),
          ("buffer", "temporaries", "#4e79a7"))
ADAPTER_SITE_FIELDS = ("conv", "c_in", "c_out", "kernel", "scale", "activation", "params")


def as_allocated(plan: MemoryPlan, table: BufferTable) -> MemoryPlan:
    """The memory plan with each update written over its state (codegen/inplace.py) in one buffer, as the
    buffer table allocates it."""
    return plan.updated_in_place([name for t in table.textures for name in t.values
                                  if name.endswith(".new") and name[:-4] in t.values])


def memory_report(plan: MemoryPlan, table: BufferTable) -> tuple[dict[str, Any], bytes]:
    """(report.json's `memory` object, the timeline PNG) of the step's memory plan (the one MemoryPlanPass
    computed and put on the graph as `fblc.mem`), with the bundle's allocation from its buffer table."""
    plan = as_allocated(plan, table)
    summary = plan.summary()
    result = {**summary, **{name: int(summary[name]) for name in INTEGER_FIELDS}, "floor_ok": bool(summary["floor_ok"]),
              "device_peak": table.allocated_bytes, "texture_bytes": table.texture_bytes,
              "arena_bytes": table.arena.bytes, "arena_live_bytes": table.arena.live_bytes,
              "shared_image_bytes": table.shared_image_bytes, "arena_images": table.arena_images,
              "device_storage": "buffer" if table.buffers else "image",
              "allocated_textures": len(table.textures), "allocated_images": len(table.images)}
    if plan.adapter:
        result["adapter"] = {k: v for k, v in plan.adapter.items() if k != "sites"}
        result["adapter"]["sites"] = [{**{k: s[k] for k in ADAPTER_SITE_FIELDS}, "kind": s.get("kind", "conv")}
                                      for s in plan.adapter.get("sites", [])]
    result["timeline_plot"] = TIMELINE_PLOT
    return result, timeline_png(plan, result)


def timeline_png(plan: MemoryPlan, memory: dict[str, Any]) -> bytes:
    """A stacked area plot of live bytes per class over the launches of one step (like MemFLoRA's figure 4)."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no backend to select

    fig = Figure(figsize=(10, 4.6), dpi=110)
    ax = fig.subplots()
    layers = [(label, color, plan.timeline[cls] / 1e6) for cls, label, color in LAYERS if plan.timeline[cls].any()]
    ax.stackplot(range(plan.steps), *[values for _, _, values in layers], labels=[label for label, _, _ in layers],
                 colors=[color for _, color, _ in layers], linewidth=0)
    for at, text in ((plan.backward_from, "backward"), (plan.optimizer_from, "optimizer")):
        if at >= 0:
            ax.axvline(at, color="black", linewidth=0.8, linestyle="--")
            ax.text(at, ax.get_ylim()[1] * 0.99, f"{text} ", va="top", ha="right", fontsize=8)
    ax.set(xlabel="kernel launch", ylabel="live memory [MB]", xlim=(0, max(plan.steps - 1, 1)))
    ax.set_title(f"device {memory['device_peak'] / 1e6:.2f} MB allocated, training-state peak "
                 f"{memory['training_state_peak'] / 1e6:.2f} MB, saved {memory['saved'] / 1e6:.2f} MB", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, ncol=len(layers), frameon=False)
    # fixed margins: tight_layout's text measuring pass was a third of a small model's compile
    fig.subplots_adjust(left=0.08, right=0.98, top=0.92, bottom=0.2)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
    return buffer.getvalue()


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
    emitted = [part for k in program.kernels for part in (k.parts or [k])]  # co-launched kernels count by part
    movers = [k for k in emitted if k.family == "movement"]
    search = {"search": options.layout_search} if options.layout == "rtile" else {}
    return {"mode": options.layout, **search, "data_movement_before": len(movement), "data_movement_after": len(kept),
            "conversion_kernels": sum(1 for k in emitted if kept_names.intersection(k.nodes)),
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
