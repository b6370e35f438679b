"""A memory plan as numbers: its buffers (Buffer: class, bytes, live range over the launches), the plan
(MemoryPlan: each class's live bytes per launch, the summary report.json shows, the adapter floor check, the plan
after in-place updates) and the --device-memory check on it (check_budget, OverBudgetError). Pass memory_plan
makes the plan (plan_memory); codegen, recompute and the reports read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Collection, Iterable

import numpy as np

from fblc.errors import FblcError


CLASSES = ("weight", "optimizer", "input", "saved", "mask", "grad", "replay", "buffer")
TRAINING_STATE = ("weight", "optimizer", "saved", "mask", "grad", "replay")


@dataclass
class Buffer:
    name: str
    cls: str
    bytes: int
    first: int
    last: int
    shape: list[int]
    dtype: str
    values: list[str] = field(default_factory=list)
    why: str = ""


@dataclass
class MemoryPlan:
    buffers: list[Buffer]
    steps: int
    labels: list[str]  # per launch: "k12 Conv" (the anchor op)
    backward_from: int  # first launch of the backward (-1: none)
    optimizer_from: int
    timeline: dict[str, np.ndarray]  # class -> live bytes per launch
    batch: int
    rank: int
    adapter: dict[str, Any]
    #: pass recompute's summary (budget, estimates, layers recomputed, FLOPs added); empty without a budget
    recompute: dict[str, Any] = field(default_factory=dict)

    def updated_in_place(self, names: Collection[str]) -> MemoryPlan:
        """This plan where the updates of `names` (`.new` values) write over their states (codegen/inplace.py
        decides it from the kernels, after this pass): such a `.new` takes no buffer of its own, its bytes are its
        state's, live the whole step. What the runtimes allocate, so `live_peak` and `device_peak` count alike."""
        merged = set(names)
        kept = [b for b in self.buffers if not merged & set(b.values or [b.name])]
        if len(kept) == len(self.buffers):
            return self
        return replace(self, buffers=kept, timeline=_timeline(kept, self.steps))

    def total(self, cls: str) -> int:
        return sum(b.bytes for b in self.buffers if b.cls == cls)

    def live(self, classes: Iterable[str]) -> np.ndarray:
        out = np.zeros(self.steps, np.int64)
        for cls in classes:
            out += self.timeline[cls]
        return out

    def summary(self) -> dict[str, Any]:
        state = self.live(TRAINING_STATE)
        device = self.live(CLASSES)
        buffers = self.timeline["buffer"]
        floor = self.floor_check()
        peak_at = int(np.argmax(device)) if self.steps else 0
        state_at = int(np.argmax(state)) if self.steps else 0
        return {
            "weights": self.total("weight"), "grads": self.total("grad"), "optimizer": self.total("optimizer"),
            "saved": self.total("saved") + self.total("mask"), "buffers": int(buffers.max(initial=0)),
            "training_state_peak": int(state.max(initial=0)), "live_peak": int(device.max(initial=0)),
            "floor_ok": floor["ok"],
            "inputs": self.total("input"), "saved_activations": self.total("saved"), "saved_masks": self.total("mask"),
            "replay_peak": int(self.timeline["replay"].max(initial=0)),
            "training_state_peak_at": self.labels[state_at] if self.steps else "",
            "live_peak_at": self.labels[peak_at] if self.steps else "",
            "launches": self.steps, "backward_from": self.backward_from, "batch": self.batch,
            "accounting": "float tensors at the bytes of their storage (fp32 4, fp16 2 per element), masks bit-packed at 1 bit per element (their r_mask8 "
                          "images); lifetimes over the kernel launch order, freed after their last reader",
            "floor": floor,
            **({"recompute": self.recompute} if self.recompute else {}),
        }

    def floor_check(self) -> dict[str, Any]:
        entries = []
        for b in self.buffers:
            if b.cls not in ("saved", "mask") and not (b.cls == "grad" and b.why.startswith("kept for")):
                continue
            width = b.cls == "saved" and not b.why.startswith("loss") and len(b.shape) >= 2 and b.shape[1] > self.rank
            entries.append({"name": b.name, "bytes": b.bytes, "shape": b.shape, "dtype": b.dtype,
                            "kind": {"mask": "bit mask", "grad": "dL/dq"}.get(b.cls, "activation"), "why": b.why,
                            "scales_with_width": bool(width)})
        entries.sort(key=lambda e: -e["bytes"])
        violations = [e["name"] for e in entries if e["scales_with_width"]]
        return {"ok": not violations, "rank": self.rank, "saved": entries, "violations": violations,
                "rule": "no saved full-precision activation of the backward may have more channels than the adapter "
                        "rank; bit masks and the loss's inputs are exempt"}


def _timeline(buffers: list[Buffer], steps: int) -> dict[str, np.ndarray]:
    """class -> the bytes of its buffers live at each launch."""
    timeline = {cls: np.zeros(steps + 1, np.int64) for cls in CLASSES}
    for b in buffers:
        timeline[b.cls][b.first] += b.bytes
        timeline[b.cls][b.last + 1] -= b.bytes
    return {cls: np.cumsum(t)[:steps] for cls, t in timeline.items()}


class OverBudgetError(FblcError):
    """The lowered step's live peak is over --device-memory; `layers_left` recomputable layers were not
    recomputed because pass recompute's estimate (node order) fit first: a lower target can still fit."""

    def __init__(self, cause: str, remedy: str, peak: int, budget: int, layers_left: int) -> None:
        super().__init__(cause, remedy)
        self.peak, self.budget, self.layers_left = peak, budget, layers_left


def check_budget(plan: MemoryPlan, budget: int, allocated: int = 0, forward: bool = False) -> None:
    """Refuse a step whose live peak, or what the runtimes allocate for it (`allocated`, the buffer table's
    device_peak), exceeds --device-memory after recompute did what it could (OverBudgetError). A `forward`
    step (--trainer none) has no backward to recompute in: its message says what it holds instead."""
    live_peak = int(plan.live(CLASSES).max(initial=0))
    peak = max(live_peak, allocated)
    if peak <= budget:
        return
    state = int(plan.live(("weight", "optimizer", "grad")).max(initial=0))
    layers = len(plan.recompute.get("layers", []))
    at = plan.labels[int(np.argmax(plan.live(CLASSES)))] if plan.steps else ""
    if allocated > live_peak:  # the textures' padding and alignment, over what is live at any launch
        at = f"the runtimes allocate it; {live_peak / 1e6:.4g} MB live at {at}"
    left = int(plan.recompute.get("layers_left", 0))
    # recompute stops where its estimate (node order) fits; fuse's launch order can keep more live than that
    why = (f"that is the floor with {layers} layers recomputed in the backward, the most checkpointing can do here"
           if not left else
           f"{layers} layers recomputed in the backward, where pass recompute's estimate "
           f"({plan.recompute.get('estimate_after', 0) / 1e6:.4g} MB, node order) fit the budget; {left} more could be "
           f"recomputed (a lower --device-memory does)")
    if forward:
        raise OverBudgetError(f"the forward bundle needs {peak / 1e6:.4g} MB of device memory at its peak ({at}), "
                              f"over --device-memory {budget / 1e6:.4g} MB (its weights alone: {state / 1e6:.4g} MB)",
                              "raise --device-memory, or need less: --weights int8/int4, --dtype fp16, a smaller "
                              "batch or sequence (--input-shape)", peak, budget, 0)
    raise OverBudgetError(f"the step needs {peak / 1e6:.4g} MB of device memory at its peak ({at}), over "
                          f"--device-memory {budget / 1e6:.4g} MB: {why} (weights, gradients and optimizer state "
                          f"alone: {state / 1e6:.4g} MB)",
                          "raise --device-memory, or need less: --adapter lora (frozen weights, no full gradients), "
                          "--dtype fp16, a smaller batch or sequence (--input-shape), --loss-chunk for a large "
                          "vocabulary", peak, budget, left)
