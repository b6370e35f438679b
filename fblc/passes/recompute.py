"""recompute: checkpointing by budget: layers whose saved activations are dropped and recomputed in the backward.

With `--device-memory MB`, when the step's live peak exceeds the budget this pass picks layers of the forward
and, for each, copies the forward nodes that make the layer's saved values into the backward, right before
their first reader there; the backward reads the copies, so the originals die at their last forward reader.
The numbers do not change: the copies compute what the originals did, from the same inputs.

Layers are found from the graph: a cut is a forward node after which exactly one forward activation is still
to be read (a residual stream between transformer or residual blocks; Constant outputs do not count); the
nodes between two cuts are one layer, and its input (the cut's value) stays saved. Layers holding a node with
more than activations to give (a graph output such as BatchNorm's running statistics, or a random op) are
never recomputed. The choice is greedy by saved bytes freed per FLOP recomputed, each pick followed by a new
estimate, until the estimate fits the budget or no layer is left.
Estimate: `plan_memory` over this graph in node order (every value its own buffer, at its ONNX dtype, but views
of weights and weights dequantized in their readers' loads none, as after tile_remap and fuse). Mostly above what
the lowered plan says (fused kernels keep values in registers; fp16 storage halves them), but no bound: fuse's
launch order can keep a value longer than node order does (2-layer 1B-width LoRA int4, every layer recomputed:
estimate 477 MB, lowered 499 MB); the memory plan at the end checks the budget against the lowered plan
(MemoryPlanPass).

Rewrite: copies of forward nodes in stage `backward` (metadata `fblc.recompute` = the layer), readers in
the backward moved to them; the model's `fblc.recompute` (JSON: budget, estimate before/after, layers,
FLOPs added). Preconditions: the gradient pass ran (facts `gradients`). In place; `modified` when a layer
was picked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.flops import node_flops
from fblc.compiler.graph import Emitter
from fblc.compiler.keys import Role
from fblc.passes.contracts import ContractPass
from fblc.passes.memory_plan import CLASSES, plan_memory

STATEFUL = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
            "Dropout")


@dataclass
class Layer:
    index: int
    nodes: list[ir.Node]  # forward nodes between two cuts, in graph order
    saved: list[ir.Value] = field(default_factory=list)  # values made here that the backward reads
    saved_bytes: int = 0
    flops: int = 0  # of the nodes the saved values need

    @property
    def density(self) -> float:
        return self.saved_bytes / max(self.flops, 1)


def _stage(node: ir.Node) -> str:
    return node.metadata_props.get(keys.STAGE, "forward")


def _bytes(value: ir.Value) -> int:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return 0
    count = 1
    for d in shape:
        count *= int(d)
    return int(count * ir.DataType(value.dtype).itemsize)


def find_layers(graph: ir.Graph) -> list[Layer]:
    """The forward split at its cuts (see the module's docstring), with each layer's saved values."""
    forward = [n for n in graph if _stage(n) == "forward"]
    position = {id(n): i for i, n in enumerate(forward)}
    last_read: dict[int, int] = {}
    for node in forward:
        for value in node.inputs:
            producer = None if value is None else value.producer()
            if producer is not None and id(producer) in position and producer.op_type != "Constant":
                last_read[id(value)] = max(last_read.get(id(value), -1), position[id(node)])
    # the data inputs are activations too: a layer that reads one beside another value is no cut
    pending = set()
    for value in graph.inputs:
        if keys.get_role(value) == Role.INPUT.value:
            reads = [position[id(r)] for r, _ in value.uses() if id(r) in position]
            if reads:
                last_read[id(value)] = max(reads)
                pending.add(id(value))
    layers: list[Layer] = []
    start = 0
    for i, node in enumerate(forward):
        pending.update(id(o) for o in node.outputs if o is not None and id(o) in last_read)
        pending = {v for v in pending if last_read[v] > i}
        if len(pending) <= 1 and i + 1 > start:
            layers.append(Layer(len(layers), forward[start:i + 1]))
            start = i + 1
    if start < len(forward):
        layers.append(Layer(len(layers), forward[start:]))
    data = _data_dependent(graph)
    for layer in layers:
        _fill(layer, data)
    return [layer for layer in layers if layer.saved and _recomputable(layer)]


def _data_dependent(graph: ir.Graph) -> set[int]:
    """Values computed from the step's data inputs (activations; a transposed weight is not one)."""
    found = {id(v) for v in graph.inputs if keys.get_role(v) == Role.INPUT.value}
    for node in graph:
        if any(v is not None and id(v) in found for v in node.inputs):
            found.update(id(o) for o in node.outputs if o is not None)
    return found


def _needed(layer: Layer) -> list[ir.Node]:
    """The layer's nodes that its saved values depend on, in graph order."""
    inside = {id(n) for n in layer.nodes}
    wanted = {id(v.producer()) for v in layer.saved}
    for node in reversed(layer.nodes):
        if id(node) in wanted:
            wanted.update(id(v.producer()) for v in node.inputs
                          if v is not None and v.producer() is not None and id(v.producer()) in inside)
    return [n for n in layer.nodes if id(n) in wanted and n.op_type != "Constant"]  # copies read the constants


def _fill(layer: Layer, data: set[int]) -> None:
    """The values the layer makes that the backward reads, but not its output to later layers: that is the
    checkpoint the next layer's copies start from, saved either way."""
    inside = {id(n) for n in layer.nodes}
    for node in layer.nodes:
        for value in node.outputs:
            if value is None or value.is_graph_output() or id(value) not in data:
                continue
            stages = [(_stage(reader), id(reader) in inside) for reader, _ in value.uses()]
            if ("backward", False) in stages and ("forward", False) not in stages:
                layer.saved.append(value)
    layer.saved_bytes = sum(_bytes(v) for v in layer.saved)
    layer.flops = sum(node_flops(n) for n in _needed(layer)) if layer.saved else 0


def _recomputable(layer: Layer) -> bool:
    return not any(n.op_type in STATEFUL or any(o is not None and o.is_graph_output() for o in n.outputs)
                   for n in layer.nodes)


def recompute_layer(graph: ir.Graph, layer: Layer) -> None:
    """Copy the nodes the layer's saved values need before the first backward reader of any; the backward
    reads the copies."""
    saved_ids = {id(v) for v in layer.saved}
    readers = [n for n in graph if _stage(n) == "backward" and any(v is not None and id(v) in saved_ids
                                                                    for v in n.inputs)]
    if not readers:
        return
    e = Emitter(graph, stage="backward")
    e.prefix = f"recompute/layer{layer.index}"
    e.anchor = readers[0]
    mapping: dict[int, ir.Value] = {}
    for node in _needed(layer):
        inputs = [None if v is None else mapping.get(id(v), v) for v in node.inputs]
        outputs = [ir.Value(name=f"{e.fresh_name(node.op_type)}:{i}", shape=o.shape, type=o.type)
                   for i, o in enumerate(node.outputs)]
        copy = ir.Node(node.domain, node.op_type, inputs, list(node.attributes.values()), outputs=outputs,
                       name=e.fresh_name(node.op_type))
        for key, text in node.metadata_props.items():
            if key not in (keys.STAGE, keys.KERNEL):
                copy.metadata_props[key] = text
        copy.metadata_props[keys.STAGE] = "backward"
        copy.metadata_props[keys.RECOMPUTE] = str(layer.index)
        graph.insert_before(readers[0], copy)
        for old, new in zip(node.outputs, copy.outputs):
            mapping[id(old)] = new
    for reader in readers:
        for index, value in enumerate(reader.inputs):
            if value is not None and id(value) in saved_ids:
                reader.replace_input_with(index, mapping[id(value)])


def estimate(model: ir.Model) -> tuple[int, set[str]]:
    """The memory plan's live peak over node order (the step is not lowered yet: no kernels, no formats), and
    the saved values live at that peak (only their layers can lower it)."""
    plan = plan_memory(model)
    live = plan.live(CLASSES)
    at = int(np.argmax(live)) if plan.steps else 0
    saved = {name for b in plan.buffers if b.cls in ("saved", "mask") and b.first <= at <= b.last for name in b.values}
    return int(live.max(initial=0)), saved


class Recompute(ContractPass):
    """Checkpointing: recompute layers in the backward until the live peak fits `budget` bytes (in place)."""

    name = "recompute"
    requires_facts = ("static shapes", "gradients")
    ensures_facts = ("static shapes", "gradients")

    def __init__(self, budget: int = 0) -> None:
        super().__init__()
        self.budget = budget  # bytes; 0: no budget, nothing recomputed

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.budget <= 0:
            return ir.passes.PassResult(model, False)
        before, live_saved = estimate(model)
        peak = before
        picked: list[dict[str, object]] = []
        layers = sorted(find_layers(model.graph), key=lambda layer: -layer.density)
        while peak > self.budget:
            # the densest layer among those with a saved value live at the peak: the others cannot lower it
            layer = next((lay for lay in layers if any(v.name in live_saved for v in lay.saved)), None)
            if layer is None:  # the floor of checkpointing: what is live at the peak is not recomputable saved state
                layers = []  # none left that could lower it
                break
            layers.remove(layer)
            recompute_layer(model.graph, layer)
            peak, live_saved = estimate(model)
            picked.append({"layer": layer.index, "first": layer.nodes[0].name, "last": layer.nodes[-1].name,
                           "saved_bytes": layer.saved_bytes, "flops": layer.flops, "estimate_after": peak})
        model.metadata_props[keys.RECOMPUTE] = json.dumps({
            "budget": self.budget, "estimate_before": before, "estimate_after": peak, "layers": picked,
            "layers_left": len(layers),  # recomputable layers not picked because the estimate fit first
            "flops_added": sum(int(p["flops"]) for p in picked),  # type: ignore[call-overload]
            "estimate": "live peak over node order, every value its own buffer at its ONNX dtype"})
        return ir.passes.PassResult(model, bool(picked))
