"""Lowering a fused step graph (every node carries `fblc.kernel`) to a `Program`: the kernels, the textures with
their initial contents, the launch order, the state swaps that make the `.new` outputs the next step's inputs, and
the loop an ES step repeats its members' launches in (docs/ARCHITECTURE.md §3; fblc.compiler.es_loop). Every group without an emitter, or that its emitter refuses, is named in one error.
`buffer_table` then gives each texture its lifetime and the image it shares (plan.json's `images`, §4).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from fblc.bundle_format import FLOAT_FORMATS, NUMPY_DTYPES, image_bytes
from fblc.codegen.arena import Arena, Lifetime, pack_arena
from fblc.codegen.cl import Kernel
from fblc.codegen.co_launch import co_launch, co_launched
from fblc.codegen.collector import collector_paused
from fblc.codegen.inplace import in_place_pairs, merge_textures
from fblc.codegen.params import PackedConstant, TextureContents
from fblc.codegen.ir.precision import half_arithmetic
from fblc.codegen.kernels import KERNEL_EMITTERS, KernelGroup
from fblc.codegen.kernels.schedules import decide_schedules, mask_layouts
from fblc.codegen.render.source import assemble_source
from fblc.codegen.share import share_kernels
from fblc.codegen.schedule import Schedule
from fblc.codegen.textures import Texture, TextureTable
from fblc.compiler import keys
from fblc.compiler.loss_scale import SKIPPED
from fblc.compiler.shapes import no_element
from fblc.errors import FblcError, UnsupportedOpError
from fblc.compiler.gaps import mark_refusal
from fblc.compiler.es_loop import BODY, carried_pairs
from fblc.compiler.index_map import is_view, map_of
from fblc.compiler.values import static_shape
from fblc.compiler.weight_data import constant_tensor
from fblc.compiler.ops import CONTRACTIONS
from fblc.passes.fuse import ALIAS, IN_READERS, REDUCTIONS, kernel_of
from fblc.passes.kernel_schedules import Decide, ScheduleDecisions
from fblc.passes.commit_if_finite import FINITE
from fblc.passes.rtile_select import state_pairs
from fblc.passes.storage_precision import storage_of
from fblc.profiles import Profile


@dataclass(frozen=True)
class Loop:
    """Launches [begin, end) of the plan, run `count` times in a row; after each repetition the runtimes swap
    the textures of every (carried, next) pair in `swaps`, so the next repetition reads what this one made."""

    begin: int
    end: int
    count: int
    swaps: tuple[tuple[int, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"begin": self.begin, "end": self.end, "count": self.count, "swaps": [list(p) for p in self.swaps]}


def loop_of(graph: ir.Graph, count: int, group_kernels: list[tuple[KernelGroup, range]],
            values: Mapping[str, int]) -> list[Loop]:
    """The plan's loop over the kernels of the groups in the loop's body (keys.LOOP_PHASE, pass es_loop): one
    range of launches, repeated `count` times; [] for a step without one."""
    body = [index for group, kernels in group_kernels if group.anchor.metadata_props.get(keys.LOOP_PHASE) == BODY
            for index in kernels]
    if not body:
        return []
    if body != list(range(body[0], body[-1] + 1)):
        raise AssertionError(f"the loop's kernels {body} are not one range of launches: did fuse order them?")
    if count < 1:
        raise AssertionError(f"a step with a loop body repeats it {count} times")
    pairs = carried_pairs(graph)
    mismatched = [carried.name for carried, following in pairs if storage_of(carried) != storage_of(following)]
    if mismatched:
        raise AssertionError(f"loop-carried {mismatched} and their next values differ in storage format: a swap "
                             f"would read one as the other")
    swaps = tuple((values[carried.name], values[following.name]) for carried, following in pairs)
    return [Loop(body[0], body[-1] + 1, count, swaps)]


@dataclass
class Program:
    kernels: list[Kernel]
    textures: list[Texture]
    initial: dict[int, TextureContents]  # texture id -> its initial texels (given piece by piece: codegen/params.py)
    values: dict[str, int]  # every named value -> texture id
    value_shapes: dict[str, list[int]]  # every named value -> its own shape (a view's differs from its texture's)
    swaps: list[tuple[int, int]]  # (state texture, its .new texture) after each step
    value_maps: dict[str, dict[str, object]]  # strided views: shape, strides, offset
    source: str
    kernel_lines: dict[str, tuple[int, int]]
    schedules: dict[str, dict[str, object]]  # kernel name -> its schedule, as used
    #: (state, .new) pairs swapped only after a step whose `finite_flag` texture (the metric `skipped`) reads 0
    finite_swaps: list[tuple[int, int]] = field(default_factory=list)
    finite_flag: int | None = None
    #: plan.json's `loops`: launches [begin, end) run `count` times, each carried (texture, next texture) pair
    #: swapped after every repetition (ES members in a loop: fblc.compiler.es_loop)
    loops: list[Loop] = field(default_factory=list)

    def repetitions(self, index: int) -> int:
        """How often a step runs launch `index`: its loop's count, else once."""
        return next((loop.count for loop in self.loops if loop.begin <= index < loop.end), 1)

    def family_counts(self) -> dict[str, int]:
        return dict(Counter(k.family for k in self.kernels))


def kernel_groups(graph: ir.Graph) -> list[KernelGroup]:
    """The fuse pass's groups in launch order (k0, k1, ...) that launch kernels, so need their anchor's
    emitter: not views (`alias`), not a group nothing reads (e.g. an unused optional output), not a
    Constant (its texture is preloaded). The anchor is the group's contraction or (first) reduction; the
    members after it are sibling reductions and elementwise ops its emitter writes as expressions; a
    group's outputs are the values others read."""
    members: dict[str, list[ir.Node]] = {}
    for node in graph:
        kernel = kernel_of(node)
        if kernel is None:
            raise ValueError(f"node '{node.name}' has no {keys.KERNEL}; run the fuse pass first")
        if kernel not in (ALIAS, IN_READERS):
            members.setdefault(kernel, []).append(node)
    graph_outputs = {id(v) for v in graph.outputs}
    groups = []
    for kernel in sorted(members, key=lambda k: int(k[1:])):
        anchor = next((n for n in members[kernel] if n.op_type in CONTRACTIONS or n.op_type in REDUCTIONS),
                      members[kernel][0])
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
    kernel name applied (kernels/schedules.py), and the layouts of the saved masks whose bytes they split
    (r_mask4, or r_mask8 bytes pairing their tiles' rows)."""
    table = TextureTable(profile, FLOAT_FORMATS[dtype], tiled=graph.metadata_props.get(keys.LAYOUT_MODE) == "rtile")
    table.schedules = decide_schedules(table, groups, overrides)
    table.mask_layouts = mask_layouts(table.schedules, table, graph)
    return table


@collector_paused
def lower(model: ir.Model, profile: Profile, dtype: str, with_contents: bool = True,
          overrides: Mapping[str, Mapping[str, Any]] | None = None, co_launched_kernels: bool = True) -> Program:
    """Kernels and textures for the fused step graph `model`; `with_contents=False` leaves out the
    initial texture contents (the parameters packed into their layouts), e.g. to time codegen alone;
    `co_launched_kernels=False` launches every kernel alone (fblc tune times and checks kernels one by one)."""
    graph = model.graph
    groups = kernel_groups(graph)
    emitted = [g for g in groups if KERNEL_EMITTERS.has(g.anchor)]
    table = _scheduled_table(graph, profile, dtype, emitted, overrides)
    for group, decided in zip(emitted, _decided(table.schedules, emitted)):  # the kernel_schedules pass put these
        recorded = group.anchor.metadata_props.get(keys.SCHEDULE)  # decisions on the step: they must be these
        if recorded is not None and recorded != decided:
            raise AssertionError(f"{group.name}: the step's schedule {recorded} is not the one lowering decides "
                                 f"({decided}): were they given different overrides?")
    kernels: list[Kernel] = []
    refusals: list[FblcError] = []
    group_kernels: list[tuple[KernelGroup, range]] = []  # each group's launches
    for group in emitted:
        empty = [r for v in group.outputs if (r := no_element(v)) is not None]  # an integer one: shapes let it pass
        if empty:
            refusals.append(empty[0])
            continue
        try:
            start = len(kernels)
            kernels.extend(KERNEL_EMITTERS.lookup(group.anchor)(table, group))
            group_kernels.append((group, range(start, len(kernels))))
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
    initial: dict[int, TextureContents] = {  # packed as params.bin is written, never all in memory
        t.id: PackedConstant(roots[t.name], t.layout, np.dtype(NUMPY_DTYPES[t.format]), t.packed_bits) for t in table.textures
        if with_contents and t.name in roots and constant_tensor(roots[t.name]) is not None}
    pairs = state_pairs(graph)
    swaps = [(values[state.name], values[update.name]) for state, update in pairs]
    for state, new in swaps:  # the next step reads the .new image through the state's layout
        if table.textures[state].layout != table.textures[new].layout:
            raise AssertionError(f"'{table.textures[state].name}' and '{table.textures[new].name}' swap images after "
                                 "a step but were given different layouts")
    committed = {o.name for o in graph.outputs if o.metadata_props.get(keys.COMMIT) == FINITE}  # commit_if_finite
    gated = [f"{state.name}.new" in committed for state, _ in pairs]
    finite_swaps = [pair for pair, g in zip(swaps, gated) if g]  # a skipped step keeps the old value: two textures
    swaps = [pair for pair, g in zip(swaps, gated) if not g]
    loops = loop_of(graph, int(keys.json_of(model.metadata_props, keys.ES, {}).get("loop", 0)), group_kernels, values)
    in_place = in_place_pairs(kernels, table.textures, swaps, {t for loop in loops for pair in loop.swaps for t in pair},
                              {index for loop in loops for index in range(loop.begin, loop.end)})
    if in_place:  # the update writes over the state: one texture, no swap
        renumber = merge_textures(kernels, table.textures, values, initial, in_place)
        swaps = [(renumber[s], renumber[n]) for s, n in swaps if (s, n) not in in_place]
        finite_swaps = [(renumber[s], renumber[n]) for s, n in finite_swaps]
        loops = [replace(loop, swaps=tuple((renumber[c], renumber[n]) for c, n in loop.swaps)) for loop in loops]
    maps = {n.outputs[0].name: map_of(n.outputs[0]) for n in graph if is_view(n) and n.outputs[0].name in values}
    value_maps = {name: {"shape": list(m.shape), "strides": list(m.strides), "offset": m.offset}
                  for name, m in maps.items() if not m.contiguous}  # strided views
    if dtype == "fp16" and profile.fp16:
        compute_in_half(kernels, table, graph)
    schedules = {k.name: table.schedules[k.name].record() for k in kernels}
    if co_launched_kernels:
        kernels = co_launch(kernels, profile, bool(loops))
    # an update in place reads and writes one texture: its two arguments alias (a co-launched part's, in its function)
    for kernel in (unit for launch in kernels for unit in (*launch.parts, launch)):
        both = set(kernel.inputs) & set(kernel.outputs)
        kernel.ir.aliased = frozenset([f"in{k}" for k, t in enumerate(kernel.inputs) if t in both]
                                      + [f"out{k}" for k, t in enumerate(kernel.outputs) if t in both])
    share_kernels(kernels)
    source, kernel_lines = assemble_source(kernels, [t.layout for t in table.textures])
    return Program(kernels, table.textures, initial, values, value_shapes, swaps, value_maps, source, kernel_lines,
                   {k.name: co_launched(schedules, k) for k in kernels}, finite_swaps,
                   values[SKIPPED] if finite_swaps else None, loops)


def compute_in_half(kernels: list[Kernel], table: TextureTable, graph: ir.Graph) -> None:
    """Each kernel that writes only half textures computes in half, reading the parameters as half too
    (codegen/ir/precision.py): under --dtype fp16 for a target with cl_khr_fp16 (its profile's `fp16`)."""
    parameters = {v.name for v in graph.inputs if keys.get_role(v) == keys.Role.PARAM.value}
    held = {t.id for t in table.textures if t.name in parameters}
    for kernel in kernels:
        kernel.ir = half_arithmetic(kernel.ir, [k for k, texture in enumerate(kernel.inputs) if texture in held])


def _decided(schedules: Mapping[str, Schedule], groups: Sequence[KernelGroup]) -> list[str]:
    """For each group, JSON of its kernels' schedules (the group's name, or it and "_" then more) as decided,
    before any kernel is built (fblc.schedule). The kernels are found by their names' prefixes, indexed once."""
    by_prefix: dict[str, list[str]] = {}
    for name in schedules:
        cuts = [k for k, character in enumerate(name) if character == "_"]
        for prefix in {name, *(name[:k] for k in cuts)}:
            by_prefix.setdefault(prefix, []).append(name)
    return [json.dumps({name: schedules[name].decided() for name in by_prefix.get(group.name, [])}, sort_keys=True)
            for group in groups]


def step_schedules(profile: Profile, dtype: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Decide:
    """The decisions the kernel_schedules pass puts on the fused step: every kernel's schedule (on its
    group's anchor) and the layouts of the saved masks whose bytes the schedules split, as lower() decides
    them."""
    def decide(model: ir.Model) -> ScheduleDecisions:
        groups = [g for g in kernel_groups(model.graph) if KERNEL_EMITTERS.has(g.anchor)]
        table = _scheduled_table(model.graph, profile, dtype, groups, overrides)
        return ScheduleDecisions(list(zip((g.anchor for g in groups), _decided(table.schedules, groups))),
                                 {name: layout.to_json() for name, layout in table.mask_layouts.items()})

    return decide


@dataclass
class BufferTable:
    """Every texture of a program with its lifetime, where the runtimes put it, and the bytes they allocate, as
    the memory report and plan.json give them: the arena (codegen/arena.py: every texture at an offset of one
    buffer, what buffer storage and, on a target with cl_khr_image2d_from_buffer, image storage allocate) and the
    shared images (`images`: textures of one format and width with disjoint lifetimes in one image, what image
    storage allocates on a device without the extension). A texture is the buffer here; the memory plan's
    buffers (fblc.passes.memory_plan.Buffer) are the step graph's values before."""

    textures: list[Texture]  # by texture id
    lifetimes: list[Lifetime]  # by texture id
    images: list[dict[str, Any]]  # plan.json's images: format, width, height, textures
    image_of: list[int]  # texture id -> image
    arena: Arena
    arena_images: bool  # image storage makes its images over the arena (the target can, and it is the smaller)
    buffers: bool  # the target runs buffer storage (a `cpu` profile: LocalRunner's storage "auto" there)

    @property
    def texture_bytes(self) -> int:
        """Every texture in an image of its own."""
        return sum(t.image_bytes for t in self.textures)

    @property
    def shared_image_bytes(self) -> int:
        """The shared images' bytes: what image storage allocates without cl_khr_image2d_from_buffer."""
        return sum(image_bytes(i["format"], i["width"], i["height"]) for i in self.images)

    @property
    def allocated_bytes(self) -> int:
        """What the runtimes allocate on the target in the storage they use there: the arena in buffers (a CPU) or
        where images can be made over a buffer, else the shared images."""
        return self.arena.bytes if self.buffers or self.arena_images else self.shared_image_bytes


def through_loops(lifetimes: list[Lifetime], loops: list[Loop]) -> list[Lifetime]:
    """`lifetimes` with each texture that a loop's body reads and a launch before the loop made living until the
    loop's last launch: every repetition reads it, not only the first (no texture may take its image before)."""
    for loop in loops:
        lifetimes = [(first, max(last, loop.end - 1)) if first < loop.begin <= last else (first, last)
                     for first, last in lifetimes]
    return lifetimes


#: graph inputs the runtimes upload before every step (not state that persists across steps)
DATA_ROLES = (keys.Role.INPUT.value, keys.Role.LABEL.value)


def arena_lifetimes(model: ir.Model, program: Program, lifetimes: list[Lifetime], pinned: set[int]) -> list[Lifetime]:
    """Each texture's launches in the arena: its own, but a pinned texture holds its bytes from the step's start
    (uploaded before it) to its end (read after it), except that a step's data input (uploaded before every
    step) is free after its last reader and an output that is no state (a gradient, the loss, read after the
    step) holds nothing before its writer. States, parameters and constants keep the whole step."""
    end = max(len(program.kernels) - 1, 0)
    data = {program.values[v.name] for v in model.graph.inputs
            if v.name in program.values and keys.get_role(v) in DATA_ROLES}
    kept = (set(program.initial) | {t for pair in program.swaps + program.finite_swaps for t in pair}
            | {t for loop in program.loops for pair in loop.swaps for t in pair}
            | {program.values[v.name] for v in model.graph.inputs if v.name in program.values} - data)
    outputs = {program.values[v.name] for v in model.graph.outputs if v.name in program.values}  # the loss included
    result = []
    for texture in program.textures:
        first, last = lifetimes[texture.id]
        if first < 0 or texture.id in kept or texture.id in data and texture.id in outputs:
            result.append((0, end))
        elif texture.id in data:
            result.append((0, last))
        elif texture.id in outputs:
            result.append((first, end))
        else:
            result.append((0, end) if texture.id in pinned else (first, last))
    return result


def buffer_table(model: ir.Model, program: Program, profile: Profile) -> BufferTable:
    """The program's textures with their lifetimes, the images they share and their places in the arena.
    Pinned textures keep an image of their own and the whole step in the arena: the runtimes read or write them
    (graph inputs and outputs, the loss), they carry initial data (parameters, constants) or state across steps
    (the swapped pairs), or no kernel uses them. The others share: in the arena, any two whose lifetimes do not
    overlap; among the images, textures of one format and width whose lifetimes do not overlap take one image,
    as tall as the tallest of them (a texture's texels sit at the same places in a taller image of its width).
    Sharing by format alone, in images as wide and tall as their largest texture, would also be valid (no kernel
    reads an image's size, and the sampler's CLK_ADDRESS_NONE makes no edge read defined) but took more: for
    MemFLoRA MobileNetV2 B=64 a greedy by first use gave 228-238 MiB against 97 MiB, a small texture taking a
    wider free image that same-width ones then lacked."""
    uses: dict[int, list[int]] = {}  # texture id -> the kernels that read or write it
    for index, kernel in enumerate(program.kernels):
        for texture_id in kernel.outputs + kernel.inputs:
            uses.setdefault(texture_id, []).append(index)
    lifetimes = [(uses[t.id][0], uses[t.id][-1]) if t.id in uses else (-1, -1) for t in program.textures]
    lifetimes = through_loops(lifetimes, program.loops)
    carried = {t for loop in program.loops for pair in loop.swaps for t in pair}
    outside = list(model.graph.inputs) + list(model.graph.outputs)
    pinned = (set(program.initial) | {t for pair in program.swaps + program.finite_swaps for t in pair} | carried
              | {program.values[v.name] for v in outside if v.name in program.values})
    images: list[dict[str, Any]] = []
    image_of = [-1] * len(program.textures)
    free_after: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (format, width) -> [(last use, image)]
    for texture in sorted(program.textures, key=lambda t: lifetimes[t.id][0]):
        first, last = lifetimes[texture.id]
        key = (texture.format, texture.width)
        shareable = texture.id not in pinned and first >= 0
        candidates = [c for c in free_after.get(key, []) if c[0] < first] if shareable else []
        # the free image closest in height: the smallest that is tall enough, else the tallest
        reusable = min(candidates, default=None, key=lambda c: (images[c[1]]["height"] < texture.height,
                                                                abs(images[c[1]]["height"] - texture.height)))
        if reusable is not None:
            free_after[key].remove(reusable)
            image = reusable[1]
            images[image]["height"] = max(images[image]["height"], texture.height)
        else:
            image = len(images)
            images.append({"format": texture.format, "width": texture.width, "height": texture.height,
                           "textures": []})
        images[image]["textures"].append(texture.id)
        image_of[texture.id] = image
        if shareable:
            free_after.setdefault(key, []).append((last, image))
    arena = pack_arena(program.textures, arena_lifetimes(model, program, lifetimes, pinned), profile)
    table = BufferTable(program.textures, lifetimes, images, image_of, arena, False, profile.cpu)
    # images over the arena where the target makes them and they take less than the shared images (a small step's
    # slots, each aligned and with a window's slack, can take more)
    table.arena_images = profile.image2d_from_buffer and arena.bytes < table.shared_image_bytes
    return table
