"""Lowering a fused step graph (every node carries `fblc.kernel`) to a `Program`: the kernels, the textures with
their initial contents, the launch order, and the state swaps that make the `.new` outputs the next step's inputs
(docs/ARCHITECTURE.md §3). Every group without an emitter, or that its emitter refuses, is named in one error.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import onnx_ir as ir

from fblc.bundle_format import FLOAT_FORMATS, NUMPY_DTYPES
from fblc.codegen.cl import Kernel
from fblc.codegen import ir as kir
from fblc.codegen.kernels import KERNEL_EMITTERS, KernelGroup
from fblc.codegen.kernels.schedules import decide_schedules, mask4_layouts
from fblc.codegen.render.source import assemble_source
from fblc.codegen.schedule import Schedule
from fblc.codegen.textures import Texture, TextureTable
from fblc.compiler import keys
from fblc.errors import FblcError, UnsupportedOpError
from fblc.compiler.gaps import mark_refusal
from fblc.compiler.index_map import is_view, map_of
from fblc.compiler.values import const_array, static_shape
from fblc.compiler.ops import CONTRACTIONS
from fblc.passes.fuse import ALIAS, kernel_of
from fblc.passes.kernel_schedules import Decide, ScheduleDecisions
from fblc.passes.rtile_select import state_pairs
from fblc.profiles import Profile
from fblc.texel_layout import pack


@dataclass
class Program:
    kernels: list[Kernel]
    textures: list[Texture]
    initial: dict[int, np.ndarray]  # texture id -> texels
    values: dict[str, int]  # every named value -> texture id
    value_shapes: dict[str, list[int]]  # every named value -> its own shape (a view's differs from its texture's)
    swaps: list[tuple[int, int]]  # (state texture, its .new texture) after each step
    value_maps: dict[str, dict[str, object]]  # strided views: shape, strides, offset
    source: str
    kernel_lines: dict[str, tuple[int, int]]
    schedules: dict[str, dict[str, object]]  # kernel name -> its schedule, as used

    def family_counts(self) -> dict[str, int]:
        return dict(Counter(k.family for k in self.kernels))


def kernel_groups(graph: ir.Graph) -> list[KernelGroup]:
    """The fuse pass's groups in launch order (k0, k1, ...) that launch kernels, so need their anchor's
    emitter: not views (`alias`), not a group nothing reads (e.g. an unused optional output), not a
    Constant (its texture is preloaded). Members after the anchor are elementwise ops its emitter writes
    as expressions; a group's outputs are the values others read."""
    members: dict[str, list[ir.Node]] = {}
    for node in graph:
        kernel = kernel_of(node)
        if kernel is None:
            raise ValueError(f"node '{node.name}' has no {keys.KERNEL}; run the fuse pass first")
        if kernel != ALIAS:
            members.setdefault(kernel, []).append(node)
    graph_outputs = {id(v) for v in graph.outputs}
    groups = []
    for kernel in sorted(members, key=lambda k: int(k[1:])):
        anchor = next((n for n in members[kernel] if n.op_type in CONTRACTIONS), members[kernel][0])
        nodes = [anchor] + [n for n in members[kernel] if n is not anchor]
        inside = {id(n) for n in nodes}
        outputs = [v for n in nodes for v in n.outputs if v is not None and v.name
                   and (id(v) in graph_outputs or any(id(u.node) not in inside for u in v.uses()))]
        if outputs and anchor.op_type != "Constant":
            groups.append(KernelGroup(f"{kernel}_{anchor.op_type}", nodes, outputs))
    return groups


def _scheduled_table(graph: ir.Graph, profile: Profile, dtype: str, groups: list[KernelGroup],
                     overrides: Mapping[str, Mapping[str, Any]] | None) -> TextureTable:
    """The step's texture table with the schedules of `groups` (the emitted ones) decided, `overrides` by
    kernel name applied (kernels/schedules.py), and the r_mask4 layouts of the saved masks they split."""
    table = TextureTable(profile, FLOAT_FORMATS[dtype], tiled=graph.metadata_props.get(keys.LAYOUT_MODE) == "rtile")
    table.schedules = decide_schedules(table, groups, overrides)
    table.mask4 = mask4_layouts(table.schedules, table, graph)
    return table


def lower(model: ir.Model, profile: Profile, dtype: str, with_contents: bool = True,
          overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Program:
    """Kernels and textures for the fused step graph `model`; `with_contents=False` leaves out the
    initial texture contents (the parameters packed into their layouts), e.g. to time codegen alone."""
    graph = model.graph
    groups = kernel_groups(graph)
    emitted = [g for g in groups if KERNEL_EMITTERS.has(g.anchor)]
    table = _scheduled_table(graph, profile, dtype, emitted, overrides)
    for group in emitted:  # the kernel_schedules pass put these decisions on the step: they must be these
        recorded = group.anchor.metadata_props.get(keys.SCHEDULE)
        if recorded is not None and recorded != _decided(table.schedules, group):
            raise AssertionError(f"{group.name}: the step's schedule {recorded} is not the one lowering decides "
                                 f"({_decided(table.schedules, group)}): were they given different overrides?")
    kernels: list[Kernel] = []
    refusals: list[FblcError] = []
    for group in emitted:
        try:
            kernels.extend(KERNEL_EMITTERS.lookup(group.anchor)(table, group))
        except UnsupportedOpError as refusal:  # e.g. an attribute the emitter does not handle; find the others too
            refusals.append(mark_refusal(refusal, group.anchor))
    gaps = KERNEL_EMITTERS.missing(g.anchor for g in groups)
    if gaps or refusals:
        raise KERNEL_EMITTERS.error(gaps, refusals)
    for value in list(graph.inputs) + list(graph.outputs) + list(graph.initializers.values()):
        table.of(value)
    values = {name: texture.id for texture in table.textures for name in texture.values}
    named = [v for n in graph for v in n.outputs if v is not None and v.name in values]
    value_shapes = {v.name: list(static_shape(v)) for v in [*named, *graph.inputs, *graph.initializers.values()]}
    roots = {v.name: v for v in graph.initializers.values()}
    roots.update({n.outputs[0].name: n.outputs[0] for n in graph if n.op_type == "Constant"})
    initial = {t.id: pack(array, t.layout, np.dtype(NUMPY_DTYPES[t.format])) for t in table.textures
               if with_contents and t.name in roots and (array := const_array(roots[t.name])) is not None}
    swaps = [(values[state.name], values[update.name]) for state, update in state_pairs(graph)]
    for state, new in swaps:  # the next step reads the .new image through the state's layout
        if table.textures[state].layout != table.textures[new].layout:
            raise AssertionError(f"'{table.textures[state].name}' and '{table.textures[new].name}' swap images after "
                                 "a step but were given different layouts")
    maps = {n.outputs[0].name: map_of(n.outputs[0]) for n in graph if is_view(n) and n.outputs[0].name in values}
    value_maps = {name: {"shape": list(m.shape), "strides": list(m.strides), "offset": m.offset}
                  for name, m in maps.items() if not m.contiguous}  # strided views
    share_kernels(kernels)
    source, kernel_lines = assemble_source(kernels, [t.layout for t in table.textures])
    return Program(kernels, table.textures, initial, values, value_shapes, swaps, value_maps, source, kernel_lines,
                   {k.name: table.schedules[k.name].record() for k in kernels})


def _decided(schedules: Mapping[str, Schedule], group: KernelGroup) -> str:
    """JSON of the group's kernels' schedules as decided, before any kernel is built (fblc.schedule)."""
    return json.dumps({name: schedule.decided() for name, schedule in schedules.items()
                       if name == group.name or name.startswith(f"{group.name}_")}, sort_keys=True)


def step_schedules(profile: Profile, dtype: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Decide:
    """The decisions the kernel_schedules pass puts on the fused step: every kernel's schedule (on its
    group's anchor) and the r_mask4 layouts of the saved masks the schedules split, as lower() decides them."""
    def decide(model: ir.Model) -> ScheduleDecisions:
        groups = [g for g in kernel_groups(model.graph) if KERNEL_EMITTERS.has(g.anchor)]
        table = _scheduled_table(model.graph, profile, dtype, groups, overrides)
        return ScheduleDecisions([(g.anchor, _decided(table.schedules, g)) for g in groups],
                                 {name: layout.to_json() for name, layout in table.mask4.items()})

    return decide


def share_kernels(kernels: list[Kernel]) -> None:
    """Set each kernel's `function`: its own name, or that of the first kernel with equal IR (the same
    arguments and body; names aside), whose __kernel its launches then share. Optimizer updates and backward
    pieces of same-shaped tensors repeat exactly: building each once shortens the OpenCL compile."""
    firsts: dict[tuple[kir.Argument, ...], list[Kernel]] = {}
    for kernel in kernels:
        body = kernel.ir
        assert isinstance(body, kir.KernelIR), f"{kernel.name} has no IR"
        alike = firsts.setdefault(tuple(body.arguments), [])
        first = next((k for k in alike if k.ir.body == body.body), None)  # type: ignore[attr-defined]
        if first is None:
            alike.append(kernel)
        kernel.function = (first or kernel).name
