"""Writing a bundle (see fblc/bundle_format.py): all files into a temporary folder, then one rename."""

from __future__ import annotations

import dataclasses

import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable

import onnx_ir as ir

from fblc import __version__, bundle_format as fmt
from fblc.codegen.cl import Kernel
from fblc.codegen.params import ParamsFile
from fblc.codegen.plan import BufferTable, Program
from fblc.codegen.render.opencl import BUFFER
from fblc.codegen.render.source import assemble_source
from fblc.compiler import keys
from fblc.errors import FblcError
from fblc.paths import mode_for, parents_made, write_error
from fblc.compiler.es import MEMBER_PREFIX
from fblc.compiler.keys import Role
from fblc.compiler.losses import IGNORE_INDEX
from fblc.compiler.torch_names import manifest_fields
from fblc.compiler.values import static_shape
from fblc.profiles import Profile

#: report.json `timings` keys: the seconds spent writing params.bin (packing and hashing the weights included),
#: and the process's CPU seconds in them (the rest is waiting for the disk)
WRITE_PARAMS, WRITE_PARAMS_CPU = "write_params", "write_params_cpu"


def _tensor_entry(value: ir.Value, program: Program) -> dict[str, Any]:
    texture = program.textures[program.values[value.name]]
    entry = {"name": value.name, "shape": list(static_shape(value)), "dtype": ir.DataType(value.dtype).name.lower(),
             "texture": texture.id, "layout": "linear-rgba"}
    if value.name in program.value_maps:  # a remapped view: element i is texture element offset + i . strides
        entry["layout"], entry["view"] = "strided-view", program.value_maps[value.name]
    if keys.CLASSES in value.metadata_props:  # class-index labels: the runtimes check the data against these
        entry["classes"], entry["ignore_index"] = int(value.metadata_props[keys.CLASSES]), IGNORE_INDEX
    if keys.INDEX_TABLE in value.metadata_props:  # ids that index a table: checked against its size likewise
        entry["indexes"] = keys.json_of(value.metadata_props, keys.INDEX_TABLE)
    return entry


def _specialist_entry(name: str, graph: ir.Graph, program: Program,
                      with_init: Callable[[ir.Value], dict[str, Any]]) -> dict[str, Any]:
    """The manifest entry of an adapter site (with_init's): the root of a texture that params.bin fills (its views, as
    FuRA-S's per-site slices of delta, read it), so that a runtime replacing its texels replaces this tensor."""
    value = graph.initializers.get(name)
    entry = with_init(value) if value is not None and name in program.values else None
    texture = program.textures[entry["texture"]] if entry is not None else None
    if entry is None or texture is None or "offset" not in entry or "view" in entry or texture.name != name:
        raise FblcError(f"adapter tensor '{name}' is not the root of a texture with initial data in the bundle (a "
                        "pass after forward_step rewrote it), so a specialist could not replace it",
                        "report it; meanwhile serve the merged model (fblc export, then compile that)")
    return entry


def _launch(kernel: Kernel, profile: Profile, lines: tuple[int, int], buffer_lines: tuple[int, int],
            schedule: dict[str, Any] | None) -> dict[str, Any]:
    """A launch of the plan: its kernel, its launch sizes (the profile's work-group size, the global size
    padded to whole groups; `items` work-items do work), its texture arguments, its kernel's lines in kernels.cl
    and kernels.buffer.cl, and the schedule its kernel was built with (codegen/schedule.py; readers may ignore it)."""
    global_size, group = kernel.launch(profile)
    return {"name": kernel.name, "function": kernel.function, "family": kernel.family, "items": kernel.global_size,
            "global_size": [global_size], "local_size": [group], "outputs": kernel.outputs, "inputs": kernel.inputs,
            "lines": list(lines), "buffer_lines": list(buffer_lines),
            **({"schedule": schedule} if schedule is not None else {})}


def build_documents(model: ir.Model, program: Program, table: BufferTable, profile: Profile, dtype: str,
                    report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], ParamsFile, dict[str, bytes]]:
    """(manifest without checksums, plan, params.bin to be written, {kernels.buffer.cl: its text}); textures,
    lifetimes and images from `table`. kernels.cl is program.source, the kernels in image storage."""
    buffer_source, buffer_lines = assemble_source(program.kernels, [t.layout for t in program.textures], BUFFER)
    params_file = ParamsFile(program.initial)
    offsets = params_file.offsets
    textures = []
    for texture, lifetime in zip(program.textures, table.lifetimes):
        entry = {"id": texture.id, "name": texture.name, "values": texture.values, "shape": list(texture.shape),
                 "format": texture.format, "width": texture.width, "height": texture.height,
                 "lifetime": list(lifetime)}
        if texture.layout.kind != "flat":  # absent: flat, the layout of everything a runtime reads or writes
            entry["layout"] = dataclasses.asdict(texture.layout)
        if texture.id in offsets:
            entry["init"] = {"offset": offsets[texture.id][0], "nbytes": offsets[texture.id][1]}
        entry["image"] = table.image_of[texture.id]
        entry["offset"], entry["slot"] = table.arena.offsets[texture.id], table.arena.slots[texture.id]
        if table.arena_images:
            entry["pitch"] = table.arena.pitches[texture.id]
        textures.append(entry)
    plan = {"textures": textures,
            "kernels": [_launch(k, profile, program.kernel_lines[k.name], buffer_lines[k.name],
                                program.schedules.get(k.name))
                        for k in program.kernels],
            "swaps": [list(pair) for pair in program.swaps],
            **({"loops": [loop.to_json() for loop in program.loops]} if program.loops else {}),
            **({"swaps_if_finite": {"flag": program.finite_flag,
                                    "pairs": [list(pair) for pair in program.finite_swaps]}}
               if program.finite_swaps else {}),
            "values": program.values, "value_shapes": program.value_shapes, "value_maps": program.value_maps}
    graph = model.graph
    data_inputs = [v for v in graph.inputs if keys.get_role(v) in (Role.INPUT.value, Role.LABEL.value)]
    params = [v for v in graph.inputs if keys.get_role(v) == Role.PARAM.value]
    states = [v for v in graph.inputs if keys.get_role(v) == Role.OPT_STATE.value]
    plan["images"] = table.images
    plan["arena"] = table.arena.plan_object(table.arena_images)

    def with_init(value: ir.Value) -> dict[str, Any]:
        entry = _tensor_entry(value, program)
        offset = offsets.get(entry["texture"])
        if offset is not None:
            entry["offset"], entry["nbytes"] = offset
        return entry

    manifest = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "fblc_version": __version__,
                "target": profile.name, "profile_digest": profile.digest, "dtype": dtype,
                "inputs": [_tensor_entry(v, program) for v in data_inputs],
                "outputs": [_tensor_entry(v, program) for v in graph.outputs],
                "parameters": [{**with_init(v), **manifest_fields(v)} for v in params],
                "states": [with_init(v) for v in states],
                # a forward bundle (--trainer none) has no loss: `step` says so, and its outputs are the model's
                **({"step": fmt.FORWARD_STEP} if graph.metadata_props.get(keys.FORWARD_STEP) == "1"
                   else {"loss": program.values["loss"]}),
                # scalars the runtimes report with the loss each step (ES's reward_mean)
                "metrics": [{"name": v.name, "texture": program.values[v.name]} for v in graph.outputs
                            if keys.get_role(v) == Role.METRIC.value and not static_shape(v)]}
    specialist = keys.json_of(graph.metadata_props, keys.SPECIALIST)
    if specialist is not None:  # adapter sites of a forward bundle: a runtime replaces their texels (runtime/specialist)
        manifest["specialist"] = [_specialist_entry(name, graph, program, with_init) for name in specialist]
    rewards = next((v for v in graph.inputs if keys.get_role(v) == Role.REWARD.value), None)
    if rewards is not None:  # --reward external: the runtime uploads the application's rewards mid-step
        texture = program.values[rewards.name]
        manifest["external_rewards"] = {
            "texture": texture, "count": int(static_shape(rewards)[0]),
            "launch": next(i for i, k in enumerate(program.kernels) if texture in k.inputs),
            "members": [_tensor_entry(v, program) for v in graph.outputs if v.name.startswith(MEMBER_PREFIX)]}
    return manifest, plan, params_file, {fmt.BUFFER_KERNELS: buffer_source.encode()}


def write_bundle(out_dir: str, manifest: dict[str, Any], plan: dict[str, Any], source: str,
                 params: bytes | ParamsFile, report: dict[str, Any], extra: dict[str, bytes] | None = None) -> None:
    """Write the bundle to `out_dir` atomically: a half-written bundle never exists under that name.

    `params`: params.bin's bytes, or a ParamsFile, written piece by piece (first, so that report.json's
    `timings` can say how long it took: WRITE_PARAMS).
    `extra`: more files (kernels.buffer.cl, the memory-timeline plot), checksummed in the manifest like the others.
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FblcError(f"-o '{out_dir}' is an existing file, not a bundle folder",
                        "choose a new folder name for the bundle")
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        with parents_made(parent):  # a failure below removes the parent folders made here again
            _write_in(parent, out_dir, manifest, plan, source, params, report, extra or {})
    except OSError as error:  # the CLI checked the folder first; this is a library caller, a full disk, or a change
        raise write_error("the bundle", out_dir, error) from None


def _write_params(path: str, params: bytes | ParamsFile, report: dict[str, Any]) -> str:
    """Write params.bin to `path`; returns its sha256. A ParamsFile's seconds go to report["timings"]."""
    started, cpu = time.perf_counter(), time.process_time()
    if isinstance(params, ParamsFile):
        digest = params.write_to(path)
        report.setdefault("timings", {}).update({WRITE_PARAMS: round(time.perf_counter() - started, 3),
                                                 WRITE_PARAMS_CPU: round(time.process_time() - cpu, 3)})
        return digest
    with open(path, "wb") as handle:
        handle.write(params)
    return fmt.sha256_of(path)


def _write_in(parent: str, out_dir: str, manifest: dict[str, Any], plan: dict[str, Any], source: str,
              params: bytes | ParamsFile, report: dict[str, Any], extra: dict[str, bytes]) -> None:
    """write_bundle's work in `parent`, which exists: a staging folder, then the renames; OSError if it fails,
    with the previous bundle in place."""
    staging = tempfile.mkdtemp(prefix=".fblc-bundle-", dir=parent)
    previous: str | None = None
    try:
        checksums = {fmt.PARAMS: _write_params(os.path.join(staging, fmt.PARAMS), params, report)}
        files = {fmt.PLAN: json.dumps(plan, indent=1).encode(), fmt.KERNELS: source.encode(),
                 fmt.REPORT: json.dumps(report, indent=2).encode(), **extra}
        for name, data in files.items():
            with open(os.path.join(staging, name), "wb") as handle:
                handle.write(data)
        checksums.update({name: fmt.sha256_of(os.path.join(staging, name)) for name in files})
        manifest = dict(manifest, checksums={name: checksums[name] for name in [fmt.PLAN, fmt.KERNELS, fmt.PARAMS,
                                                                              fmt.REPORT, *extra]})
        with open(os.path.join(staging, fmt.MANIFEST), "wb") as handle:
            handle.write(fmt.sealed_manifest(manifest))
        os.chmod(staging, mode_for(out_dir, folder=True))  # mkdtemp's 0700: the umask's, or the replaced bundle's
        if os.path.exists(out_dir):
            if not os.path.isfile(os.path.join(out_dir, fmt.MANIFEST)) and os.listdir(out_dir):
                raise FblcError(f"'{out_dir}' exists and is not an fblc bundle", "choose another -o folder")
            previous = tempfile.mkdtemp(prefix=".fblc-old-", dir=parent)
            os.rmdir(previous)
            os.replace(out_dir, previous)
        os.replace(staging, out_dir)
        if previous:
            shutil.rmtree(previous, ignore_errors=True)
    except OSError:  # a full disk, or the folder changed under us: the previous bundle stays
        if previous and os.path.exists(previous) and not os.path.exists(out_dir):
            os.replace(previous, out_dir)
        raise
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
