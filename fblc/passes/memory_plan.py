"""memory_plan: lifetimes over the schedule, texture reuse, and the memory decomposition of a step.

Schedule: the kernel launch order of the fuse pass (`fblc.kernel` = k<N>); views (`alias`)
share the buffer of the value they look at. Without fuse annotations, the node order.

Each buffer (a value that owns storage) gets a class, a size and a lifetime [first, last]
in launch indices:
- `weight`: initializers, Constant outputs, parameters (trainable and frozen), BatchNorm
  running statistics; `optimizer`: optimizer state read by the optimizer stage. These live over
  the whole step. `input`: data inputs and labels, uploaded before every step: from its start to
  their last reader.
- `saved`: forward values the backward reads (role `saved`); `mask` is a saved bool tensor,
  bit-packed at one bit per element (MemFLoRA's bit mask).
- `grad`: parameter gradients, and the dL/dq that memflora-sg keeps per site until its replay;
  `replay`: the full-width site inputs that memflora-sg's replay recomputes (one layer at a time).
- `buffer`: every other value (temporaries, the `.new` outputs of the step).
Sizes: elements x item size of the storage format (fp32: 4 bytes; 2 where storage_precision
stored a float tensor in half, `fblc.storage`); bool: ceil(n / 8), or, once
rtile_select gave it a mask layout, the bytes of that image (bundle_format.image_bytes, what the
runtimes allocate: ceil(n / 8) for an r_mask8 image whose width divides its bytes, twice that
for the r_mask4 fallback of a writer that cannot write whole bytes).

Reported (the paper's eq. 1, in bytes): `weights`, `grads`, `optimizer`, `saved` (totals);
`buffers` (the largest sum of live temporaries at one launch); `training_state_peak` as
MemFLoRA defines it: max over the step of weights + optimizer + live saved + live gradients
(+ live replay buffers), workspaces excluded; `live_peak`: max over the step of every live
allocation (inputs and temporaries included), the least an allocator that frees each buffer after
its last reader needs (a lower bound: what the bundle allocates, images shared by textures of one
format and width, is the buffer table's, fblc.codegen.plan.buffer_table, reported as `memory.device_peak`). The floor check lists every saved tensor with its bytes and why it
is kept, and flags any whose size grows with the layer width: a full-precision activation read
by the backward whose channel axis is wider than the adapter rank (the loss's own inputs and
one-bit masks excepted). `floor_ok` is true when none is flagged.

With a budget (`--device-memory`, which pass recompute chose layers against) a live peak over it is refused
(memory_accounting.check_budget: FblcError naming the peak, the budget and the state that no recomputation
frees); the summary carries recompute's choices (`recompute`: layers, FLOPs added).

Rewrite: annotations only: `fblc.mem` (JSON: class, bytes, live range) on every value
that owns a buffer, and the model's `fblc.memory` (JSON summary and floor check).
Preconditions (its contract): fuse's kernels and their launch order (`kernels`, `kernel order`),
the views (`index maps`), the layouts of masks (`layouts`) and the storage formats (`storage
precision`); ensures `memory plan`. In place; `modified` is true when an annotation changed.
"""

from __future__ import annotations

import json
from typing import Iterable

import onnx_ir as ir

from fblc import bundle_format as fmt
from fblc.compiler import keys
from fblc.compiler.es_loop import BODY
from fblc.compiler.keys import Role
from fblc.compiler.values import numel, static_shape
from fblc.compiler.index_map import REMAPPABLE, is_view, real_readers, view_root, views_of
from fblc.passes.fuse import ALIAS, IN_READERS, dequantized_in_readers
from fblc.passes.contracts import ContractPass
from fblc.passes.memory_accounting import (CLASSES, Buffer, MemoryPlan, OverBudgetError, _timeline,
                                           check_budget)


def _moves_data(node: ir.Node) -> bool:
    """A view, or data movement that tile_remap may make one (a weight's W^T, a Slice of it)."""
    return is_view(node) or node.op_type in REMAPPABLE


def _weight_view(graph: ir.Graph, value: ir.Value) -> bool:
    """Whether `value` is a weight seen through data movement (W^T, a Slice of it) or a quantized weight its
    contractions will dequantize as they load it (fuse.dequantized_in_readers): before tile_remap and fuse these
    are nodes with outputs, after them views (or compile-time packings) that take no buffer of the step."""
    node = value.producer()
    moved = False
    while node is not None and _moves_data(node) and node.inputs and node.inputs[0] is not None:
        value, node, moved = node.inputs[0], node.inputs[0].producer(), True
    if node is not None:
        return dequantized_in_readers(node, _moves_data)
    return moved and graph.initializers.get(value.name) is value


def _kernel_index(node: ir.Node) -> int | None:
    kernel = node.metadata_props.get(keys.KERNEL)
    if kernel is None or kernel == ALIAS or not kernel.startswith("k"):
        return None
    return int(kernel[1:])


def _bytes(value: ir.Value) -> int:
    count = numel(static_shape(value))
    dtype = ir.DataType(value.dtype)
    if dtype == ir.DataType.BOOL:
        layout = keys.layout_of(value)
        if layout is not None and layout.kind in fmt.MASK_FORMATS:
            return fmt.image_bytes(fmt.MASK_FORMATS[layout.kind], layout.width, layout.height)
        return (count + 7) // 8
    if value.metadata_props.get(keys.STORAGE) == "fp16":  # a half texture (storage_precision)
        return 2 * count
    return int(count * dtype.itemsize)


def _dtype_name(value: ir.Value) -> str:
    """The element type as stored on the device (a half texture under mixed precision)."""
    if value.metadata_props.get(keys.STORAGE) == "fp16":
        return "float16"
    return ir.DataType(value.dtype).name.lower()


def launch_schedule(graph: ir.Graph) -> tuple[dict[int, int], int, list[str], list[str]]:
    """node id -> launch index, the number of launches, a label and a stage per launch.

    A launch's stage is that of its earliest node: the fuse pass may compute a backward
    expression of a forward value inside the forward kernel that makes the value.
    """
    nodes = list(graph)
    fused = any(keys.KERNEL in n.metadata_props for n in nodes)
    index: dict[int, int] = {}
    labels: dict[int, str] = {}
    stages: dict[int, str] = {}
    for position, node in enumerate(nodes):
        k = _kernel_index(node) if fused else (None if is_view(node) else position)
        if k is None:
            continue
        index[id(node)] = k
        if k not in labels:
            labels[k] = f"{'k' if fused else 'n'}{k} {node.op_type}"
            stages[k] = node.metadata_props.get(keys.STAGE, "forward")
    steps = max(index.values(), default=-1) + 1
    return (index, steps, [labels.get(k, f"k{k}") for k in range(steps)],
            [stages.get(k, "forward") for k in range(steps)])


def _optimizer_states(graph: ir.Graph) -> set[str]:
    """Names of opt_state inputs whose update the optimizer stage computes (not BN running statistics)."""
    names = set()
    for out in graph.outputs:
        if out.name.endswith(".new"):
            producer = view_root(out).producer()
            if producer is not None and producer.metadata_props.get(keys.STAGE) == "optimizer":
                names.add(out.name[: -len(".new")])
    return names


def _why_saved(value: ir.Value, made_in: str) -> str:
    """The forward ops whose backward reads `value` (made in a launch of stage `made_in`)."""
    origins = sorted({n.metadata_props.get(keys.GRAD_OF, "?") for n in real_readers(value)
                      if n.metadata_props.get(keys.STAGE) == "backward"})
    where = "loss: " if made_in == "loss" else ""
    shown = ", ".join(origins[:3]) + (f" and {len(origins) - 3} more" if len(origins) > 3 else "")
    return f"{where}read by the backward of {shown}" if origins else f"{where}read by the backward"


def plan_memory(model: ir.Model) -> MemoryPlan:
    """Lifetimes, classes and the per-launch timeline of the step graph."""
    graph = model.graph
    index, steps, labels, stages = launch_schedule(graph)
    fused = any(keys.KERNEL in n.metadata_props for n in graph)
    if steps == 0:  # no launch at all (the step only views its inputs): one empty launch holds the timeline
        steps, labels, stages = 1, ["(no launch)"], ["forward"]
    last_step = steps - 1
    optimizer_states = _optimizer_states(graph)
    roots: dict[int, ir.Value] = {}
    members: dict[int, list[str]] = {}

    def add(value: ir.Value) -> None:
        root = view_root(value)
        roots.setdefault(id(root), root)
        members.setdefault(id(root), [])
        if value.name and value.name not in members[id(root)]:
            members[id(root)].append(value.name)

    for value in list(graph.inputs) + list(graph.initializers.values()):
        add(value)
    for node in graph:
        for value in node.outputs:
            if value is not None and value.shape is not None:
                add(value)
    graph_outputs = {id(view_root(v)) for v in graph.outputs}
    body = [index[id(n)] for n in graph if n.metadata_props.get(keys.LOOP_PHASE) == BODY and id(n) in index]
    loop = (min(body), max(body)) if body else None  # the launches a loop repeats (es_loop)
    backward_from = next((k for k, stage in enumerate(stages) if stage == "backward"), -1)
    optimizer_from = next((k for k, stage in enumerate(stages) if stage == "optimizer"), -1)
    buffers: list[Buffer] = []
    for key, root in roots.items():
        producer = root.producer()
        if producer is not None and producer.metadata_props.get(keys.KERNEL) == IN_READERS:
            continue  # a weight its contractions dequantize as they load it: never stored (fuse.IN_READERS)
        if not fused and _weight_view(graph, root):
            continue  # before the layout passes (pass recompute's estimate): a view of a weight, as it will be
        names = members[key]
        role = keys.get_role(root)
        views = views_of(root)
        roles = {role} | {keys.get_role(v) for v in views}
        tags: dict[str, str] = {}
        for v in [root] + views:
            for k, text in v.metadata_props.items():
                tags.setdefault(k, text)
        persistent = producer is None or producer.op_type == "Constant"
        if persistent:
            if role in (Role.INPUT.value, Role.LABEL.value):
                cls = "input"
            elif role == Role.OPT_STATE.value and root.name in optimizer_states:
                cls = "optimizer"
            else:
                cls = "weight"
            first, last = 0, last_step
            readers = [index[id(n)] for n in real_readers(root) if id(n) in index]
            if cls == "input" and readers and key not in graph_outputs:  # uploaded before every step: free after
                last = max(readers) if loop is None or max(readers) < loop[0] else max(max(readers), loop[1])
        else:
            first = index.get(id(producer), 0)
            readers = [index[id(n)] for n in real_readers(root) if id(n) in index]
            if fused and key not in graph_outputs and all(r == first for r in readers):
                continue  # lives inside its kernel (registers), or nothing reads it: no texture
            made_in = stages[first] if first < len(stages) else "forward"
            read_in = {stages[r] for r in readers if r < len(stages)}
            if Role.GRAD.value in roles or keys.ADAPTER_SITE_DQ in tags:
                cls = "grad"
            elif keys.ADAPTER_REPLAY in tags:
                cls = "replay"
            elif made_in in ("forward", "loss") and "backward" in read_in:
                cls = "mask" if root.dtype == ir.DataType.BOOL else "saved"
            else:
                cls = "buffer"
            last = last_step if key in graph_outputs else max(readers + [first])
            if loop is not None and first < loop[0] <= last:  # read by a loop's body: live until its last repetition
                last = max(last, loop[1])
        why = ""
        if cls in ("saved", "mask"):
            why = _why_saved(root, made_in)
        elif cls == "grad" and keys.ADAPTER_SITE_DQ in tags:
            why = f"kept for the replay: dL/d({tags[keys.ADAPTER_SITE_DQ]})"
        buffers.append(Buffer(name=root.name or (names[0] if names else ""), cls=cls, bytes=_bytes(root), first=first,
                              last=last, shape=list(static_shape(root)), dtype=_dtype_name(root),
                              values=names, why=why))
    timeline = _timeline(buffers, steps)
    batch = next((static_shape(v)[0] for v in graph.inputs if keys.get_role(v) == Role.INPUT.value
                  and len(static_shape(v)) > 0), 0)
    adapter = keys.json_of(model.metadata_props, keys.ADAPTER, {})
    rank = int(adapter.get("rank", 0)) if adapter.get("adapter") not in (None, "none") else 0
    return MemoryPlan(buffers, steps, labels, backward_from, optimizer_from, timeline,
                      int(batch), rank, adapter, keys.json_of(model.metadata_props, keys.RECOMPUTE, {}))


class MemoryPlanPass(ContractPass):
    """Annotate buffers with class, size and lifetime; summarise (in place)."""

    name = "memory_plan"
    requires_facts = ("kernels", "kernel order", "index maps", "layouts", "storage precision")
    ensures_facts = ("memory plan",)
    plan: MemoryPlan | None = None  # the plan of the last step annotated (fblc compile's report.json reads it)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # kept for report.json and --device-memory's check (fblc compile, after the buffer table): planned once
        plan = self.plan = plan_memory(model)
        modified = False
        by_name = {b.name: b for b in plan.buffers}
        for value in _all_values(model.graph):
            b = by_name.get(value.name)
            if b is None or view_root(value) is not value:
                continue
            text = json.dumps({"class": b.cls, "bytes": b.bytes, "live": [b.first, b.last]})
            if value.metadata_props.get(keys.MEM) != text:
                value.metadata_props[keys.MEM] = text
                modified = True
        summary = plan.summary()
        summary["floor"]["saved"] = summary["floor"]["saved"][:200]
        text = json.dumps(summary)
        if model.metadata_props.get(keys.MEMORY) != text:
            model.metadata_props[keys.MEMORY] = text
            modified = True
        return ir.passes.PassResult(model, modified)


def _all_values(graph: ir.Graph) -> Iterable[ir.Value]:
    yield from graph.inputs
    yield from graph.initializers.values()
    for node in graph:
        yield from (v for v in node.outputs if v is not None)


__all__ = ["Buffer", "CLASSES", "MemoryPlan", "MemoryPlanPass", "OverBudgetError", "check_budget", "plan_memory"]
