"""The `memory` object of report.json and the memory-timeline plot of a bundle.

Both come from the memory plan (fblc.passes.memory_plan) that MemoryPlanPass computed on the fused step:
the paper's eq. 1 decomposition, the training-state peak, the floor check, and what the
bundle's textures really take, from the buffer table (fblc.codegen.buffers): `device_peak`, the
one device-memory figure, the bytes of the images plan.json lists and the runtimes allocate
(textures with disjoint lifetimes share one, each at the bytes of its format); `texture_bytes`,
every texture with an image of its own; `live_peak`, the planner's lower bound (every buffer
freed after its last reader, nothing padded). Saved masks sit in r_mask8 images, 1 bit per
element, the bytes the plan accounts them at (it reads their layouts).
"""

from __future__ import annotations

import io
from typing import Any

from fblc.codegen.buffers import BufferTable
from fblc.passes.memory_plan import CLASSES, MemoryPlan

TIMELINE_PLOT = "memory_timeline.png"
INTEGER_FIELDS = ("weights", "grads", "optimizer", "saved", "buffers", "training_state_peak", "live_peak")
#: stacking order and colours of the plot (bottom to top)
LAYERS = (("weight", "weights", "#8c8c8c"), ("optimizer", "optimizer state", "#b07aa1"), ("input", "inputs", "#9c755f"),
          ("grad", "gradients", "#59a14f"), ("saved", "saved activations", "#e15759"), ("mask", "saved bit masks", "#ff9da7"),
          ("replay", "replay buffers", "#edc948"), ("buffer", "temporaries", "#4e79a7"))


def memory_object(plan: MemoryPlan, table: BufferTable, plot: str | None = TIMELINE_PLOT) -> dict[str, Any]:
    summary = plan.summary()
    result: dict[str, Any] = {name: int(summary[name]) for name in INTEGER_FIELDS}
    result["floor_ok"] = bool(summary["floor_ok"])
    for name, value in summary.items():
        if name not in result:
            result[name] = value
    result["device_peak"], result["texture_bytes"] = table.allocated_bytes, table.texture_bytes
    result["allocated_textures"], result["allocated_images"] = len(table.textures), len(table.images)
    if plan.adapter:
        result["adapter"] = {k: v for k, v in plan.adapter.items() if k != "sites"}
        result["adapter"]["sites"] = [{**{k: s[k] for k in ("conv", "c_in", "c_out", "kernel", "scale", "activation",
                                                             "params")}, "kind": s.get("kind", "conv")}
                                      for s in plan.adapter.get("sites", [])]
    if plot:
        result["timeline_plot"] = plot
    return result


def timeline_png(plan: MemoryPlan, device_peak: int, title: str = "") -> bytes:
    """A stacked area plot of live bytes per class over the launches of one step (like MemFLoRA's figure 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(plan.steps))
    fig, ax = plt.subplots(figsize=(10, 4.6), dpi=110)
    layers = [(label, color, plan.timeline[cls] / 1e6) for cls, label, color in LAYERS if plan.timeline[cls].any()]
    ax.stackplot(steps, *[values for _, _, values in layers], labels=[label for label, _, _ in layers],
                 colors=[color for _, color, _ in layers], linewidth=0)
    summary = plan.summary()
    for at, text in ((plan.backward_from, "backward"), (plan.optimizer_from, "optimizer")):
        if at >= 0:
            ax.axvline(at, color="black", linewidth=0.8, linestyle="--")
            ax.text(at, ax.get_ylim()[1] * 0.99, f"{text} ", va="top", ha="right", fontsize=8)
    ax.set_xlabel("kernel launch")
    ax.set_ylabel("live memory [MB]")
    ax.set_xlim(0, max(plan.steps - 1, 1))
    ax.set_title(title or (f"device {device_peak / 1e6:.2f} MB allocated, training-state peak "
                           f"{summary['training_state_peak'] / 1e6:.2f} MB, saved {summary['saved'] / 1e6:.2f} MB"),
                 fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, ncol=len(layers), frameon=False)
    # fixed margins: tight_layout's text measuring pass was a third of a small model's compile
    fig.subplots_adjust(left=0.08, right=0.98, top=0.92, bottom=0.2)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
    plt.close(fig)
    return buffer.getvalue()


def memory_report(plan: MemoryPlan, table: BufferTable) -> tuple[dict[str, Any], bytes]:
    """(report.json's `memory` object, the timeline PNG) of the step's memory plan (the one MemoryPlanPass
    computed and put on the graph as `fblc.mem`), with the bundle's allocation from its buffer table."""
    return memory_object(plan, table), timeline_png(plan, table.allocated_bytes)


__all__ = ["CLASSES", "INTEGER_FIELDS", "TIMELINE_PLOT", "memory_object", "memory_report", "timeline_png"]
