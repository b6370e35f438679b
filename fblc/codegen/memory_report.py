"""The `memory` object of report.json and the memory-timeline plot of a bundle, from the step's memory
plan (fblc.passes.memory_plan: eq. 1's decomposition, the training-state peak, the floor check) and the
buffer table (fblc.codegen.buffers). `device_peak` is the one device-memory figure: the images plan.json
lists and the runtimes allocate; `texture_bytes` gives every texture an image of its own; `live_peak` is
the planner's lower bound (every buffer freed after its last reader, nothing padded).
"""

from __future__ import annotations

import io
from typing import Any

from fblc.codegen.buffers import BufferTable
from fblc.passes.memory_plan import MemoryPlan

TIMELINE_PLOT = "memory_timeline.png"
INTEGER_FIELDS = ("weights", "grads", "optimizer", "saved", "buffers", "training_state_peak", "live_peak")
#: stacking order and colours of the plot (bottom to top)
LAYERS = (("weight", "weights", "#8c8c8c"), ("optimizer", "optimizer state", "#b07aa1"),
          ("input", "inputs", "#9c755f"), ("grad", "gradients", "#59a14f"), ("saved", "saved activations", "#e15759"),
          ("mask", "saved bit masks", "#ff9da7"), ("replay", "replay buffers", "#edc948"),
          ("buffer", "temporaries", "#4e79a7"))
ADAPTER_SITE_FIELDS = ("conv", "c_in", "c_out", "kernel", "scale", "activation", "params")


def memory_report(plan: MemoryPlan, table: BufferTable) -> tuple[dict[str, Any], bytes]:
    """(report.json's `memory` object, the timeline PNG) of the step's memory plan (the one MemoryPlanPass
    computed and put on the graph as `fblc.mem`), with the bundle's allocation from its buffer table."""
    summary = plan.summary()
    result = {**summary, **{name: int(summary[name]) for name in INTEGER_FIELDS}, "floor_ok": bool(summary["floor_ok"]),
              "device_peak": table.allocated_bytes, "texture_bytes": table.texture_bytes,
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
