"""A kernel's shape key: what decides its kernel and the speed of each of its schedules, the same in every model
that has that kernel (`fblc tune` keeps the fastest schedule per shape key in a profile's `schedules`; plan.json
records each launch's key as its schedule's `shape_key`).

The key is "Op/<16 hex digits>": the anchor's op type (and the kernel's suffix where a group launches several
kernels, e.g. LayerNormalization_stats), then a digest of what the schedule rules and the emitter read:

- the anchor's domain, op type and attributes;
- each anchor input's and each group output's shape, element type and texel layout (R-Tile tile, packing,
  arrangement), the index map a view reads its root through, and the contents of small integer constants
  (a reduction's axes, a reshape's shape: the emitter folds them into the kernel);
- the storage's float format (fp32 or fp16 textures) and the layout mode (R-Tile codegen or naive).

Left out on purpose: value and node names (they differ between models), the contents of float tensors (weights
never shape a kernel), the elementwise members fused after the anchor (each runs once per output whatever the
tile, so they shift every candidate's time alike and never change which is fastest), and a saved mask's layout
kind (mask8 or mask4 is a consequence of the schedule, kernel_schedules' fallback, not an input to it: the key
must be the same before and after that pass). A hash of the kernel's IR with the schedule fields blanked was the
alternative; it is known only after the kernel is built from its schedule, and the overrides must be found
before (codegen/kernels/schedules.decide_schedules).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import onnx_ir as ir

from fblc.codegen.kernels import KernelGroup
from fblc.codegen.schedule import SHAPE_SEPARATOR
from fblc.compiler import keys
from fblc.compiler.index_map import map_of, view_root
from fblc.compiler.values import const_array

#: integer constants up to this many elements enter the key by their contents (axes, shapes, pads)
SMALL_CONSTANT = 16
MASK_KINDS = ("mask8", "mask4")
#: the suffixes of the further kernels a group may launch (kernels/schedules.py: LayerNormalization's statistics)
SUFFIXES = ("_stats",)

def shape_key(group: KernelGroup, kernel: str, float_format: str, tiled: bool) -> str:
    """The shape key of `kernel`, one of `group`'s kernels (see the module docstring)."""
    anchor = group.anchor
    suffix = kernel[len(group.name):]  # "" or "_stats"
    document = {"op": [anchor.domain, anchor.op_type, suffix],
                "attributes": {name: _attribute(attr) for name, attr in sorted(anchor.attributes.items())},
                "inputs": [_value(v) for v in anchor.inputs], "outputs": [_value(v) for v in group.outputs],
                "format": float_format, "tiled": tiled}
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]
    return f"{anchor.op_type}{suffix}{SHAPE_SEPARATOR}{digest}"


def describe(group: KernelGroup, kernel: str) -> str:
    """"Gemm [8,32] [64,32] [64] -> [8,64]": the kernel's op, its anchor's input shapes, its outputs' shapes."""
    def shapes(values: list[ir.Value | None]) -> str:
        return " ".join("-" if v is None or v.shape is None else str(list(v.shape)).replace(" ", "") for v in values)

    return f"{group.anchor.op_type}{kernel[len(group.name):]} {shapes(list(group.anchor.inputs))} -> " \
           f"{shapes(list(group.outputs))}"


def _value(value: ir.Value | None) -> dict[str, Any] | None:
    if value is None:
        return None
    root = view_root(value)
    layout = keys.json_of(root.metadata_props, keys.LAYOUT, None)
    if isinstance(layout, dict) and layout.get("kind") in MASK_KINDS:
        layout = {"kind": "mask"}
    entry: dict[str, Any] = {"shape": [int(d) for d in value.shape] if value.shape is not None else None,
                             "dtype": int(value.dtype) if value.dtype is not None else None, "layout": layout}
    if root is not value:
        entry["map"] = map_of(value).to_json()
    contents = const_array(value)
    if contents is not None and contents.dtype.kind in "iub" and contents.size <= SMALL_CONSTANT:
        entry["contents"] = np.asarray(contents).reshape(-1).tolist()
    return entry


def _attribute(attr: ir.Attr) -> Any:
    value = attr.value
    if isinstance(value, (int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, (int, float, str)) else repr(v) for v in value]
    if isinstance(value, ir.TensorProtocol):
        array = value.numpy()
        small = array.dtype.kind in "iub" and array.size <= SMALL_CONSTANT
        return {"shape": list(array.shape), "dtype": str(array.dtype), **({"contents": array.reshape(-1).tolist()}
                                                                          if small else {})}
    return repr(type(value).__name__)
