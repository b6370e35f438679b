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
- an ES step (model metadata `fblc.es`) also keeps in fp32 every value of its `loss` and `es`
  stages (ES_MASTER_STAGES): the loss and reward chain of the model and of each member, the
  perturbed parameters theta +/- sigma eps and their noise rows, the z-scores and the direction.
  Why: ES's signal is the spread of the members' losses, about sigma times the gradient's norm
  (1e-3 of the loss and less), while half resolves a loss near 1.7 to 2^-10 = 1e-3: with the
  loss's reductions in half textures the rewards were rounded to whole half-ulps, their z-scores
  were rounding noise (an iteration whose spread was 4e-4 moved delta 45 degrees off the fp32
  step's direction, cos 0.70) and the step's `loss` read 1.73828125 for 1.73812. The members' forwards,
  the bulk of the work, stay in half.
Kernels accumulate in fp32 whatever the format (`read_imagef` returns float): a format changes
only the image a tensor lives in. The texture table allocates, and the memory plan counts, by
this annotation.
Preconditions: the step graph with its optimizer (`updates`). In place; `modified` is true when
an annotation changed.
"""

from __future__ import annotations

from typing import Mapping

import onnx_ir as ir

from fblc.bundle_format import FLOAT_FORMATS
from fblc.compiler import keys
from fblc.compiler.es import ES_META
from fblc.compiler.index_map import is_view, view_root
from fblc.compiler.keys import Role
from fblc.compiler.values import is_float
from fblc.errors import FblcError
from fblc.passes.contracts import ContractPass
from fblc.passes.rtile_select import state_pairs

#: graph inputs kept in fp32 under mixed precision, by role
MASTER_ROLES = frozenset({Role.PARAM.value, Role.OPT_STATE.value})
#: nodes whose values stay fp32 under mixed precision, by stage: the optimizer's inputs and outputs
MASTER_STAGES: dict[str, tuple[str, ...]] = {"optimizer": ("inputs", "outputs")}
#: an ES step's as well: the outputs of its loss and ES stages (the module docstring says why)
ES_MASTER_STAGES: dict[str, tuple[str, ...]] = {**MASTER_STAGES, "loss": ("outputs",), "es": ("outputs",)}


def master_roots(graph: ir.Graph, stages: Mapping[str, tuple[str, ...]] = MASTER_STAGES) -> set[int]:
    """ids of the storage roots kept in fp32 under `--dtype fp16` (see the module docstring); `stages`:
    which values of a node of each stage stay fp32."""
    kept = [v for v in graph.inputs if keys.get_role(v) in MASTER_ROLES]
    kept += [v for pair in state_pairs(graph) for v in pair]
    kept += list(graph.outputs)
    for node in graph:
        for side in stages.get(node.metadata_props.get(keys.STAGE, ""), ()):
            kept += [v for v in getattr(node, side) if v is not None]
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
        stages = ES_MASTER_STAGES if ES_META in model.metadata_props else MASTER_STAGES
        master = master_roots(graph, stages) if self.dtype == "fp16" else set()
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
