"""report.json `weights`: the device bytes of what a step keeps between steps, by category, and the error of
each quantized weight (--weights; passes/quantize_weights.py).

A texture counts at its image's bytes (Texture.image_bytes: padded texels in its format; a packed int4/int8
tensor at 4 or 8 bits an element). Categories: `frozen_quantized` (packed integers, their fp16 scales, fp16
weights), `frozen_float` (frozen float weights kept as they are), `trainable` (parameters), `adapters`
(LoRA A/B, MemFLoRA P/U, FuRA-S R and delta: whatever an adapter made), `optimizer_state`, `constants`
(integer tables, masks and other frozen non-float tensors), and `activations_saved`, the memory plan's bytes of
activations the backward reads (memory.saved_activations).

A forward bundle with adapter sites (--trainer none --adapter) counts its sites (keys.SPECIALIST: LoRA's A/B,
MemFLoRA's U, FuRA-S's delta) apart, as `specialist`, the bytes a runtime replaces to switch specialists, and
`shared` sums the rest that a step keeps (weights, frozen factors, constants): uploaded once, whatever specialist.
"""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

from fblc.codegen.plan import Program
from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.values import is_float

CATEGORIES = ("frozen_quantized", "frozen_float", "trainable", "adapters", "optimizer_state", "constants")


def category(value: ir.Value) -> str | None:
    """The category of a stored initializer or graph input; None for data inputs (a batch's tensors)."""
    role = keys.get_role(value)
    if role == Role.OPT_STATE.value:
        return "optimizer_state"
    if keys.ADAPTER_FACTOR in value.metadata_props:
        return "adapters"
    if keys.QUANTIZED in value.metadata_props:
        return "frozen_quantized"
    if role == Role.PARAM.value:
        return "trainable"
    if value.const_value is None:
        return None
    return "frozen_float" if is_float(value) else "constants"


def weights_report(model: ir.Model, program: Program, memory: dict[str, Any], weights: str, group: int
                   ) -> dict[str, Any]:
    graph = model.graph
    stored = {v.name: v for v in [*graph.inputs, *graph.initializers.values()]}
    sites = set(keys.json_of(graph.metadata_props, keys.SPECIALIST, []))
    totals = dict.fromkeys(CATEGORIES + (("specialist",) if sites else ()), 0)
    for texture in program.textures:
        value = stored.get(texture.name)
        kind = "specialist" if texture.name in sites else category(value) if value is not None else None
        if kind is not None:
            totals[kind] += texture.image_bytes
    records = json.loads(model.metadata_props.get(keys.QUANTIZED, "[]"))
    report = {"format": weights, "group": group,
              "bytes": {**totals, "activations_saved": memory.get("saved_activations", 0)}, "quantized": records}
    if sites:
        report["shared"] = sum(totals.values()) - totals["specialist"]
    return report
