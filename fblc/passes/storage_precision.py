"""storage_precision: the format each float tensor is stored in on the device (mixed precision).

Rewrite: annotations only. Every float value that owns storage (not a view) gets `fblc.storage`:
- under `--dtype fp32`, "fp32" everywhere;
- under `--dtype fp16`, "fp16" (half textures) for activations, the values the backward saves
  and the activation gradients, and "fp32" for the master copy of training: the parameters and
  their `.new`, the optimizer state and its `.new`, every value the optimizer stage reads or
  writes (the parameter gradients it consumes), and every step output (the loss, `.grad`,
  metrics). Why: Adam's second moment of a gradient below ~2.4e-4 underflows in half, a
  parameter update smaller than half a half-ulp of the weight is lost, and both make fp16 training
  diverge or stall; an activation rounds to half without harm.
Kernels accumulate in fp32 whatever the format (`read_imagef` returns float): a format changes
only the image a tensor lives in. The texture table allocates, and the memory plan counts, by
this annotation.
Preconditions: the step graph with its optimizer (`updates`). In place; `modified` is true when
an annotation changed.
"""

from __future__ import annotations

import onnx_ir as ir

from fblc.bundle_format import FLOAT_FORMATS
from fblc.compiler import keys
from fblc.compiler.index_map import is_view, view_root
from fblc.compiler.keys import Role
from fblc.compiler.values import is_float
from fblc.errors import FblcError
from fblc.passes.contracts import ContractPass
from fblc.passes.rtile_select import state_pairs

#: graph inputs kept in fp32 under mixed precision, by role
MASTER_ROLES = frozenset({Role.PARAM.value, Role.OPT_STATE.value})


def master_roots(graph: ir.Graph) -> set[int]:
    """ids of the storage roots kept in fp32 under `--dtype fp16` (see the module docstring)."""
    kept = [v for v in graph.inputs if keys.get_role(v) in MASTER_ROLES]
    kept += [v for pair in state_pairs(graph) for v in pair]
    kept += list(graph.outputs)
    for node in graph:
        if node.metadata_props.get(keys.STAGE) == "optimizer":
            kept += [v for v in (*node.inputs, *node.outputs) if v is not None]
    return {id(view_root(v)) for v in kept}


def storage_of(value: ir.Value) -> str:
    """The format `value`'s storage root was given ("fp32" when the pass has not run)."""
    return view_root(value).metadata_props.get(keys.STORAGE, "fp32")


class StoragePrecision(ContractPass):
    """Annotate each float storage root with its device format (in place)."""

    name = "storage_precision"
    requires_facts = ("updates",)

    def __init__(self, dtype: str = "fp32") -> None:
        super().__init__()
        if dtype not in FLOAT_FORMATS:
            raise FblcError(f"unknown --dtype '{dtype}'", f"choose one of: {', '.join(FLOAT_FORMATS)}")
        self.dtype = dtype

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        master = master_roots(graph) if self.dtype == "fp16" else set()
        roots = list(graph.inputs) + list(graph.initializers.values())
        roots += [v for n in graph if not is_view(n) for v in n.outputs if v is not None and v.name]
        modified = False
        for value in roots:
            if value.dtype is None or not is_float(value):
                continue
            storage = "fp32" if self.dtype == "fp32" or id(value) in master else "fp16"
            if value.metadata_props.get(keys.STORAGE) != storage:
                value.metadata_props[keys.STORAGE] = storage
                modified = True
        return ir.passes.PassResult(model, modified)
