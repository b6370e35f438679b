"""storage_precision: the format each float tensor is stored in on the device (mixed precision).

Rewrite: annotations only. Every float value that owns storage (not a view) gets `fblc.storage`:
- under `--dtype fp32`, "fp32" everywhere;
- under `--dtype fp16`, "fp16" (half textures) for activations, the values the backward saves
  and the activation gradients, and "fp32" for the master copy of training: the parameters and
  their `.new`, the optimizer state and its `.new`, every value the optimizer stage reads or
  writes (the parameter gradients it consumes), a tensor that only data movement turns into one of
  those (a strided conv's weight gradient: a wider map sliced to the taps), and every step output
  (the loss, `.grad`, metrics). Why: Adam's second moment of a gradient below ~2.4e-4 underflows in half, a
  parameter update smaller than half a half-ulp of the weight is lost, and both make fp16 training
  diverge or stall; an activation rounds to half without harm.
- the loss chain, under either trainer (LOSS_STAGES): every value its `loss` stage reads or
  writes, from the model's prediction (the logits) on through LogSoftmax / ReduceLogSumExp and
  the loss's reductions, and under backprop the first gradients, which the backward computes for
  those nodes (`fblc.grad_of` a loss node), up to and including the gradient of the logits. Why:
  half resolves a loss near 5.5 to 2^-8 = 4e-3: with the chain in half textures the first fp16
  loss of a 37-class classifier whose logits were exact read 10.28125 for fp32's 10.284074, and no
  fp32/fp16 comparison of losses under 1e-3 meant anything. The cost: a handful of tensors of the
  logits' size at 4 bytes instead of 2 (a language model's vocabulary makes them its largest).
- statistics (STATISTICS): every reduction's result (a mean, a sum, a maximum over some axes) and
  LayerNormalization's mean and inverse standard deviation. Why: every element of its row reads a
  row's statistic back, so its half rounding (2^-11 of it) does not average out but moves the whole
  row at once, and a backward orthogonal to such a shift (LayerNorm's) leaves a sum that cancels
  nearly to zero off by that much: fuzz seed 276, Log(x * x + c) then LayerNorm, gave the gradient of
  the scalar c as -0.0320 for fp32's -0.0074 (onnxruntime with only the half textures rounded: -0.0301,
  so storage, not arithmetic); with statistics in fp32 it is within the fp16 tolerance. They are one
  value a row: fp32 costs a few bytes.
- an ES step (model metadata `fblc.es`) also keeps in fp32 every value of its `es` stage
  (ES_MASTER_STAGES): the perturbed parameters theta +/- sigma eps and their noise rows, the
  z-scores and the direction, and (loss stage) each member's loss and reward chain.
  Why: ES's signal is the spread of the members' losses, about sigma times the gradient's norm
  (1e-3 of the loss and less), while half resolves a loss near 1.7 to 2^-10 = 1e-3: with the
  loss's reductions in half textures the rewards were rounded to whole half-ulps, their z-scores
  were rounding noise (an iteration whose spread was 4e-4 moved delta 45 degrees off the fp32
  step's direction, cos 0.70) and the step's `loss` read 1.73828125 for 1.73812. The members' forwards,
  the bulk of the work, stay in half.
A format changes the image a tensor lives in; what the kernels compute in follows from it: on a
target whose profile has cl_khr_fp16 (`fp16`), a kernel whose float textures written (or read) are
all half computes in half, its accumulators in float (codegen/ir/precision.py); elsewhere every
kernel computes in float (`read_imagef` converts). The texture table allocates, and the memory plan
counts, by this annotation.
Preconditions: the step graph with its optimizer (`updates`) and its views decided (`index
maps`: a view has no storage of its own). Ensures `storage precision`. In place; `modified` is
true when an annotation changed.
"""

from __future__ import annotations

from typing import Mapping

import onnx_ir as ir

from fblc.bundle_format import FLOAT_FORMATS
from fblc.compiler import keys
from fblc.compiler.index_map import REMAPPABLE, is_view, view_root
from fblc.compiler.keys import Role
from fblc.compiler.values import is_float
from fblc.errors import FblcError
from fblc.passes.contracts import ContractPass
from fblc.passes.fuse import REDUCTIONS
from fblc.passes.rtile_select import state_pairs
from fblc.passes.tile_remap import PACKED

#: graph inputs kept in fp32 under mixed precision, by role: parameters, optimizer state, and a loop's carried
#: values (ES's member counter and rewards), which swap with their next values, graph outputs and so fp32
MASTER_ROLES = frozenset({Role.PARAM.value, Role.OPT_STATE.value, Role.CARRIED.value})
#: nodes whose values stay fp32 under mixed precision, by stage: the optimizer's inputs and outputs,
#: and the loss chain's from the logits on (the module docstring says why)
LOSS_STAGES: dict[str, tuple[str, ...]] = {"loss": ("inputs", "outputs")}
MASTER_STAGES: dict[str, tuple[str, ...]] = {"optimizer": ("inputs", "outputs"), **LOSS_STAGES}
#: an ES step's as well: the outputs of its ES stage
ES_MASTER_STAGES: dict[str, tuple[str, ...]] = {**MASTER_STAGES, "es": ("outputs",)}
#: statistics kept in fp32 under mixed precision: op -> the index of its first output that is one (a
#: reduction's result; LayerNormalization's mean and inverse standard deviation, not its Y)
STATISTICS: dict[str, int] = {**dict.fromkeys(REDUCTIONS, 0), "LayerNormalization": 1}


def loss_gradient_nodes(graph: ir.Graph) -> list[ir.Node]:
    """The backward's nodes for the loss chain: those a gradient rule emitted for a `loss` stage node,
    and the sums that join only their results (the gradient of logits that several loss nodes read)."""
    loss_nodes = {node.name for node in graph if node.metadata_props.get(keys.STAGE) in LOSS_STAGES}
    chain: list[ir.Node] = []
    produced: set[int] = set()
    for node in graph:
        if node.metadata_props.get(keys.STAGE) != "backward":
            continue
        origin = node.metadata_props.get(keys.GRAD_OF)
        upstream = [v for v in node.inputs if v is not None and v.producer() is not None and is_float(v)]
        joins_the_chain = origin is None and upstream and all(id(v) in produced for v in upstream)
        if origin in loss_nodes or joins_the_chain:
            chain.append(node)
            produced.update(id(v) for v in node.outputs if v is not None)
    return chain


def master_roots(graph: ir.Graph, stages: Mapping[str, tuple[str, ...]] = MASTER_STAGES) -> set[int]:
    """ids of the storage roots kept in fp32 under `--dtype fp16` (see the module docstring); `stages`:
    which values of a node of each stage stay fp32."""
    kept = [v for v in graph.inputs if keys.get_role(v) in MASTER_ROLES]
    kept += [v for pair in state_pairs(graph) for v in pair]
    kept += list(graph.outputs)
    for node in graph:
        for side in stages.get(node.metadata_props.get(keys.STAGE, ""), ()):
            kept += [v for v in getattr(node, side) if v is not None]
    kept += [v for node in loss_gradient_nodes(graph) for v in (*node.inputs, *node.outputs) if v is not None]
    kept += [v for node in graph if node.op_type in STATISTICS for v in node.outputs[STATISTICS[node.op_type]:]
             if v is not None]
    roots = {id(view_root(v)) for v in kept}
    # a tensor that only data movement turns into a master value is that value before it moves (a strided conv's
    # weight gradient is a wider map sliced to the kernel's taps): in half it would round, or overflow under
    # the loss scale, what the master keeps in fp32
    def moves_into_masters(value: ir.Value) -> bool:  # every reader moves it into a master (through views too)
        readers = [use.node for use in value.uses()]
        return bool(readers) and all(
            node.op_type in REMAPPABLE and (moves_into_masters(node.outputs[0]) if is_view(node)
                                            else id(view_root(node.outputs[0])) in roots) for node in readers)

    for node in reversed(list(graph)):
        if node.op_type in REMAPPABLE and not is_view(node) and id(view_root(node.outputs[0])) in roots:
            source = view_root(node.inputs[0])
            if is_float(source) and moves_into_masters(source):
                roots.add(id(source))
    # a copy of a master tensor packed in the order its reader wants (pointwise_transposes) is that tensor again
    return roots | {id(node.outputs[0]) for node in graph if node.metadata_props.get(keys.REMAP) == PACKED
                    and id(view_root(node.inputs[0])) in roots}


def storage_of(value: ir.Value) -> str:
    """The format `value`'s storage root was given ("fp32" when the pass has not run)."""
    return view_root(value).metadata_props.get(keys.STORAGE, "fp32")


class StoragePrecision(ContractPass):
    """Annotate each float storage root with its device format (in place)."""

    name = "storage_precision"
    requires_facts = ("updates", "index maps")
    ensures_facts = ("storage precision",)

    def __init__(self, dtype: str = "fp32") -> None:
        super().__init__()
        if dtype not in FLOAT_FORMATS:
            raise FblcError(f"unknown --dtype '{dtype}'", f"choose one of: {', '.join(FLOAT_FORMATS)}")
        self.dtype = dtype

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        stages = ES_MASTER_STAGES if keys.ES in model.metadata_props else MASTER_STAGES
        master = master_roots(graph, stages) if self.dtype == "fp16" else set()
        roots = list(graph.inputs) + list(graph.initializers.values())
        roots += [v for n in graph if not is_view(n) for v in n.outputs if v is not None and v.name]
        modified = False
        for value in roots:
            if value.dtype is None or not is_float(value):
                continue
            if value.const_value is not None and keys.QUANTIZED in value.metadata_props:
                continue  # quantize_weights chose its storage: an fp16 scale, a half weight
            storage = "fp32" if self.dtype == "fp32" or id(value) in master else "fp16"
            if value.metadata_props.get(keys.STORAGE) != storage:
                value.metadata_props[keys.STORAGE] = storage
                modified = True
        return ir.passes.PassResult(model, modified)
