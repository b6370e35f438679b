"""The local runtime: run a bundle's training step with pyopencl.

It reads only the bundle (manifest, plan, kernels, params) and knows nothing about ONNX.
Textures are created once; each step uploads the data inputs, launches the kernels in plan
order (a loop of the plan's launches as often as it repeats: ES members in a loop), reads the loss, then swaps
each state texture with its `.new` texture, so the next step reads the updated parameters without a copy (a
state updated in place has no `.new` texture of its own and no swap: plan.json names the state's texture).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from fblc import choices
from fblc import bundle_format as fmt
from fblc.bundle_format import BundleError
from fblc.runtime.build_progress import BuildProgress
from fblc.runtime.device_build import choose_storage, device_build_options, language_standard, unoptimised_reason
from fblc.runtime.device_memory import allocate_textures
from fblc.runtime.feeds import extra_feeds_problem, index_problem, kind_problem
from fblc.runtime import specialist as specialists
from fblc.runtime.opencl import select_device
from fblc.runtime.whole_steps import whole_step
from fblc.texel_layout import MASK_ELEMENTS, TexelLayout, pack, unpack


class KernelBuildError(BundleError):
    """The OpenCL compiler rejected a kernel."""


class DataError(BundleError):
    """Feeds that do not match what the bundle was compiled for."""


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # sys.stderr looked up now: pytest and rich may replace it


_noted_platforms: set[str] = set()  # each platform's note is said once a process


#: how a runner holds its textures (LocalRunner's `storage`); auto: chosen for the device (choose_storage)
STORAGES = choices.STORAGES


class LocalRunner:
    """Train with a bundle on a local OpenCL device: `.step(feeds) -> loss`, `.parameters()`.

    The first run of a bundle on a device compiles its kernels (a minute and more on PoCL for a large
    model): `progress` says so on stderr (True), to a callable taking each line, or not at all (False).
    `storage` "auto" holds the textures in buffers on a CPU device, as images elsewhere (choose_storage):
    `.storage` is the one chosen, `.storage_reason` why. On a device of UNOPTIMISED_PLATFORMS the kernels are
    built with -cl-opt-disable outside pyopencl's binary cache, unless `device_workarounds` is False (what
    benchmarks/instructions.py counts is the optimised kernels' instructions, not their numbers).
    """

    #: arguments after the textures, in every kernel (the read tracer's buffers)
    extra_arguments: tuple[Any, ...] = ()

    def __init__(self, bundle: str, device: str | None = None, profiling: bool = False,
                 build_options: Sequence[str] = (), progress: bool | Callable[[str], None] = True,
                 storage: str = "auto", device_workarounds: bool = True) -> None:
        import pyopencl as cl

        if storage not in STORAGES:
            raise ValueError(f"storage '{storage}': choose one of {', '.join(STORAGES)}")
        self.cl = cl
        self.bundle = bundle
        self.manifest, self.plan = fmt.load_verified(bundle)
        self.device = select_device(device)
        #: "image": every texture an image2d_t, as on a phone (kernels.cl); "buffer": the same texels in index
        #: order in a __global buffer (kernels.buffer.cl), for a device whose images are software
        #: (a CPU's OpenCL: PoCL reads a texel through a library call that stops vectorization), where
        #: a texel's address is its index, not its layout's coordinate (which on a phone serves the texture cache)
        self.storage, self.storage_reason = choose_storage(storage, self.device)
        #: why the kernels are built with -cl-opt-disable and outside pyopencl's binary cache ("": they are not)
        self.unoptimised_reason = unoptimised_reason(self.device) if device_workarounds else ""
        #: the bundle's kernel source for the storage, and its key of each launch's lines there (plan.json)
        self.kernels_file, self._lines_key = ((fmt.BUFFER_KERNELS, "buffer_lines") if self.storage == "buffer"
                                              else (fmt.KERNELS, "lines"))
        self.build_options = list(build_options) + (["-cl-opt-disable"] if self.unoptimised_reason else [])
        self.context = cl.Context([self.device])
        properties = cl.command_queue_properties.PROFILING_ENABLE if profiling else 0
        self.queue = cl.CommandQueue(self.context, properties=properties)
        self.textures = self.plan["textures"]
        self._check_limits()
        self._check_loops()
        memory = allocate_textures(cl, self.context, self.device, self.plan, self.storage)
        #: why the textures are not views of plan.json's arena ("": they are), e.g. images on a device without
        #: cl_khr_image2d_from_buffer, which then take plan.json's images, shared by one format and width
        self.arena_reason = memory.arena_reason
        self.images = memory.images
        self.binding = memory.binding  # texture id -> its image or view (swapped per step)
        self._shared = memory.shared
        self._layouts = [self._layout(t) for t in self.textures]  # texture id -> where its texels sit (packing)
        for texture in self.textures:
            self._initialise(texture)
        #: device memory this runner allocated, as the OpenCL driver reports each allocation's size (bytes)
        self.allocated_bytes = sum(int(part.get_info(cl.mem_info.SIZE)) for part in memory.allocations)
        self.allocated_images = len(memory.allocations)
        names = sorted({k["function"] for k in self.plan["kernels"]})
        say = _to_stderr if progress is True else progress or None
        platform = self.device.platform.name.strip()
        if say is not None and self.unoptimised_reason and platform not in _noted_platforms:
            _noted_platforms.add(platform)
            say(f"note: building kernels for {self.device.name.strip()} with -cl-opt-disable and outside pyopencl's "
                f"binary cache: {self.unoptimised_reason}")
        self.build_progress = BuildProgress(say, self.device, names, pyopencl_cache=not self.unoptimised_reason)
        self.build_progress.start()
        try:
            self.program = self._build()
        except BaseException:
            self.build_progress.abandon()  # the error says what went wrong; no "building" line after it
            raise
        self.build_progress.program_built()
        functions = {name: cl.Kernel(self.program, name) for name in names}
        self.kernels = [functions[k["function"]] for k in self.plan["kernels"]]
        self.steps = 0
        #: the manifest's metrics (ES's reward_mean) after the last step, by name
        self.metrics: dict[str, float] = {}
        self.swapped: list[list[int]] = []  # the (state, .new) pairs the last step swapped

    # setup -------------------------------------------------------------------------------------
    def _check_limits(self) -> None:
        width, height = self.device.image2d_max_width, self.device.image2d_max_height
        images = self.textures if self.storage == "image" else []  # a buffer has no edge limit
        for texture in images:
            if texture["width"] > width or texture["height"] > height:
                raise BundleError(f"texture of '{texture['name']}' is {texture['width']} x {texture['height']}, beyond "
                                  f"{self.device.name}'s image limit {width} x {height}; compile for a target with "
                                  "this device's limits (--target local)")
        most = self.device.max_work_group_size
        for launch in self.plan["kernels"]:
            group = (launch.get("local_size") or [1])[0]
            if group > most:
                raise BundleError(f"launch '{launch['name']}' has work-groups of {group} work-items, beyond "
                                  f"{self.device.name}'s {most}; compile for a target with this device's limits "
                                  "(--target local)")

    def _check_loops(self) -> None:
        """plan.json's loops (ES members): each a range of launches after the previous one, repeated at least once."""
        after = 0
        for loop in self.plan.get("loops", []):
            if not after <= loop["begin"] < loop["end"] <= len(self.plan["kernels"]) or loop["count"] < 1:
                raise BundleError(f"'{self.bundle}' is not a valid fblc bundle: a loop of plan.json is not a range of "
                                  "launches after the previous loop, repeated at least once; compile the bundle again")
            after = loop["end"]

    def _initialise(self, texture: dict[str, Any]) -> None:
        init = texture.get("init")
        if init is not None:
            with open(os.path.join(self.bundle, fmt.PARAMS), "rb") as handle:
                handle.seek(init["offset"])
                data = np.frombuffer(handle.read(init["nbytes"]), dtype=fmt.NUMPY_DTYPES[texture["format"]])
            self._write(self.binding[texture["id"]], texture, data)

    def _build(self) -> Any:
        cl = self.cl
        with open(os.path.join(self.bundle, self.kernels_file), encoding="utf-8") as handle:
            source = handle.read()
        program = cl.Program(self.context, source)
        try:
            return program.build(options=[*device_build_options(self.device), *self.build_options],
                                 cache_dir=False if self.unoptimised_reason else None)
        except cl.RuntimeError as error:
            log = program.get_build_info(self.device, cl.program_build_info.LOG) or str(error)
            raise KernelBuildError(f"the OpenCL compiler of {self.device.name} rejected kernel "
                                   f"{self._kernel_at(log)}:\n{log.strip()[-3000:]}") from None

    def _kernel_at(self, log: str) -> str:
        match = re.search(r"\.cl:(\d+):\d+:", log) or re.search(r":(\d+):\d+:", log)
        if match:
            line = int(match.group(1))
            for kernel in self.plan["kernels"]:
                if kernel[self._lines_key][0] <= line <= kernel[self._lines_key][1]:
                    return f"'{kernel['name']}' ({self.kernels_file} line {line})"
        return "(see the log)"

    # texture I/O -------------------------------------------------------------------------------
    def _write(self, image: int, texture: dict[str, Any], flat: np.ndarray) -> None:
        layout = self._layouts[texture["id"]]
        data = np.ascontiguousarray(flat.reshape(layout.height, layout.width, fmt.CHANNELS[texture["format"]]))
        self.cl.enqueue_copy(self.queue, self.images[image], data, **self._corner(layout))

    def _read(self, texture_id: int) -> np.ndarray:
        texture, layout = self.textures[texture_id], self._layouts[texture_id]
        data = np.empty((layout.height, layout.width, fmt.CHANNELS[texture["format"]]),
                        dtype=fmt.NUMPY_DTYPES[texture["format"]])
        self.cl.enqueue_copy(self.queue, data, self.images[self.binding[texture_id]], **self._corner(layout))
        size = int(np.prod(texture["shape"], dtype=np.int64))
        return unpack(data, layout, size).reshape(texture["shape"])

    def _corner(self, layout: TexelLayout) -> dict[str, Any]:
        """enqueue_copy's region for a texture's texels: an image shared by textures of disjoint lifetimes
        may be wider or taller than this one, which sits at its corner; a buffer's texels start at 0."""
        return {"origin": (0, 0), "region": (layout.width, layout.height)} if self.storage == "image" else {}

    def upload(self, texture_id: int, array: np.ndarray) -> None:
        texture = self.textures[texture_id]
        image = pack(array, self._layouts[texture_id], fmt.NUMPY_DTYPES[texture["format"]])
        self._write(self.binding[texture_id], texture, image)

    def _layout(self, texture: dict[str, Any]) -> TexelLayout:
        """Where the texture's texels sit: its layout in an image; in a buffer, texel (byte of a mask) t at t."""
        layout = (TexelLayout.from_dict(texture["layout"]) if "layout" in texture
                  else TexelLayout("flat", texture["width"], texture["height"]))
        if self.storage == "image":
            return layout
        if layout.kind in MASK_ELEMENTS:  # its bytes in a row, paired as in the image (mask_pair_stride)
            return TexelLayout(layout.kind, layout.width * layout.height, 1, mask_pair_stride=layout.mask_pair_stride)
        return TexelLayout("flat", layout.width * layout.height, 1)

    def read(self, name: str) -> np.ndarray:
        """Any tensor of the step by its ONNX value name (loss, P.grad, parameters...), as it is now."""
        if name not in self.plan["values"]:
            raise KeyError(f"the bundle has no tensor '{name}'")
        texture_id = self.plan["values"][name]
        if texture_id in self._shared:
            raise KeyError(f"'{name}' lives only during the step: its image is reused by later tensors")
        integer = self.textures[texture_id]["format"] in fmt.INTEGER_FORMATS
        value = self._read(texture_id).astype(np.int64 if integer else np.float32)
        return fmt.value_of(self.plan, name, value)

    def committed_swaps(self) -> list[list[int]]:
        """The (state, .new) pairs to swap after the step just run: every one of plan.json's `swaps`, and those of
        `swaps_if_finite` when its flag (the metric `skipped`) reads 0: a skipped step's updates stay in `.new`."""
        gated = self.plan.get("swaps_if_finite")
        if gated is None or float(self._read(gated["flag"]).reshape(-1)[0]) != 0.0:
            return self.plan["swaps"]
        return self.plan["swaps"] + gated["pairs"]

    def read_before_swap(self, name: str) -> np.ndarray:
        """A tensor as the last step made it: `.new` outputs and states read through the swap. A state the
        last step did not commit (skipped by loss scaling) reads as itself under its `.new` name too."""
        texture_id = self.plan["values"][name]
        kept = {new: state for state, new in self.plan.get("swaps_if_finite", {}).get("pairs", [])
                if [state, new] not in self.swapped}
        if self.steps and texture_id in kept:
            return self.read(name[: -len(".new")]) if name.endswith(".new") else self.read(name)
        swapped = {new: state for state, new in self.swapped}
        swapped.update({state: new for state, new in self.swapped})
        if self.steps and texture_id in swapped:
            self.binding[texture_id], self.binding[swapped[texture_id]] = (self.binding[swapped[texture_id]],
                                                                             self.binding[texture_id])
            try:
                return self.read(name)
            finally:
                self.binding[texture_id], self.binding[swapped[texture_id]] = (self.binding[swapped[texture_id]],
                                                                                 self.binding[texture_id])
        return self.read(name)

    # training ------------------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, np.ndarray]) -> None:
        problems = []
        for entry in self.manifest["inputs"]:
            array = feeds.get(entry["name"])
            if array is None:
                problems.append(f"'{entry['name']}' is missing")
            elif list(np.shape(array)) != entry["shape"]:
                problems.append(f"'{entry['name']}' has shape {list(np.shape(array))}")
            elif (problem := index_problem(entry, array)) is not None:  # the kernels would clamp it silently
                raise DataError(problem)
        if problems:
            expected = ", ".join(f"{e['name']} {e['shape']} {e['dtype']}" for e in self.manifest["inputs"])
            raise DataError(f"{'; '.join(problems)}; the bundle expects: {expected}")

    def step(self, feeds: Mapping[str, np.ndarray],
             reward: Callable[[list[np.ndarray]], Sequence[float]] | None = None) -> float:
        """One training step on `feeds` (model inputs and labels, as the manifest lists); returns the loss.

        An ES bundle compiled with `--reward external` runs its perturbed members' forwards, calls
        `reward(outputs)` with each member's model output (the +eps members, then the -eps members) and
        uploads the 2P rewards it returns before the update."""
        if (problem := kind_problem(self.manifest, self.bundle, forward=False)) is not None:
            raise BundleError(problem)
        self.check_feeds(feeds)
        external = self.manifest.get("external_rewards")
        if external is not None and reward is None:
            raise BundleError("this ES bundle takes its rewards from the application (--reward external); "
                              "pass step(feeds, reward=fn), fn mapping the members' outputs to their rewards")
        with whole_step():  # updates go in place: Ctrl-C waits for the step's end (runtime/whole_steps.py)
            for entry in self.manifest["inputs"]:
                self.upload(entry["texture"], np.asarray(feeds[entry["name"]]))
            if external is None:
                self.run_kernels()
            else:
                for index in self.launch_sequence(0, external["launch"]):
                    self.launch(index)
                outputs = [self.read(member["name"]) for member in external["members"]]
                self.upload(external["texture"], fmt.checked_rewards(reward(outputs), external["count"]))
                for index in self.launch_sequence(external["launch"]):
                    self.launch(index)
            self.queue.finish()  # waits with the GIL released (a blocking read holds it): build progress goes on
            loss = float(self._read(self.manifest["loss"]).reshape(-1)[0])
            self.metrics = {m["name"]: float(self._read(m["texture"]).reshape(-1)[0])
                            for m in self.manifest["metrics"]}
            self.swapped = self.committed_swaps()
            for state, new in self.swapped:
                self.binding[state], self.binding[new] = self.binding[new], self.binding[state]
            self.steps += 1
            if self.steps == 1:
                self.build_progress.first_step_done()  # PoCL compiled each kernel at its first launch
        return loss

    def load_specialist(self, tensors: Mapping[str, np.ndarray] | str | None) -> int:
        """Replace the adapter sites of a forward bundle compiled with --adapter (runtime/specialist.py) with
        `tensors` (by name, or the .npz path `fblc export --keep-adapters` wrote); None: the adapter's identity
        from params.bin again. Only those textures are written; returns their bytes."""
        entries = specialists.sites(self.manifest, self.bundle)
        if tensors is None:
            for entry in entries:
                self._initialise(self.textures[entry["texture"]])
            return specialists.site_bytes(self.manifest)
        source = f"specialist '{tensors}'" if isinstance(tensors, str) else "the specialist"
        arrays = specialists.checked(self.manifest, self.bundle,
                                    specialists.load_file(tensors) if isinstance(tensors, str) else tensors, source)
        for entry in entries:
            self.upload(entry["texture"], arrays[entry["name"]])
        return specialists.site_bytes(self.manifest)

    def infer(self, feeds: Mapping[str, np.ndarray],
              specialist: Mapping[str, np.ndarray] | str | None = None) -> dict[str, np.ndarray]:
        """A forward bundle's step (--trainer none) on `feeds` (the model's inputs, by name): the model's outputs
        by name. A training bundle, or a feed the bundle does not read, is refused by name (DataError). With
        `specialist`, load_specialist(specialist) first (it stays loaded for the next calls)."""
        if (problem := kind_problem(self.manifest, self.bundle, forward=True)) is not None:
            raise BundleError(problem)
        if (problem := extra_feeds_problem(self.manifest, self.bundle, feeds)) is not None:
            raise DataError(problem)
        self.check_feeds(feeds)
        if specialist is not None:
            self.load_specialist(specialist)
        for entry in self.manifest["inputs"]:
            self.upload(entry["texture"], np.asarray(feeds[entry["name"]]))
        self.run_kernels()
        self.queue.finish()
        outputs = {entry["name"]: self.read(entry["name"]) for entry in self.manifest["outputs"]}
        self.steps += 1
        if self.steps == 1:
            self.build_progress.first_step_done()
        return outputs

    def run_kernels(self) -> list[Any]:
        """Enqueue the step's launches in plan order, each loop's body as often as it repeats (launch_sequence);
        their events."""
        return [self.launch(index) for index in self.launch_sequence()]

    def launch_sequence(self, start: int = 0, stop: int | None = None) -> Iterator[int]:
        """The plan's launch indices start..stop in the order a step enqueues them, as it goes: a loop of plan.json
        (ES members in a loop) repeats its launches `count` times and, after each repetition, swaps the textures
        of its carried pairs (the next repetition reads what this one made). A loop must lie inside or outside
        start..stop."""
        stop = len(self.kernels) if stop is None else stop
        loops = {loop["begin"]: loop for loop in self.plan.get("loops", [])}
        index = start
        while index < stop:
            loop = loops.get(index)
            if loop is None:
                yield index
                index += 1
                continue
            if loop["end"] > stop:
                raise BundleError(f"launches {start}..{stop} end inside the loop over launches "
                                  f"{loop['begin']}..{loop['end']}")
            for _ in range(loop["count"]):
                yield from range(loop["begin"], loop["end"])
                for carried, following in loop["swaps"]:
                    self.binding[carried], self.binding[following] = self.binding[following], self.binding[carried]
            index = loop["end"]

    def launch(self, index: int, offset: int = 0, size: int | None = None) -> Any:
        """Enqueue launch `index` of the plan with its schedule (work-items offset..offset+size, whole
        work-groups; default all); its event."""
        spec = self.plan["kernels"][index]
        bound = [self.binding[t] for t in spec["outputs"] + spec["inputs"]]
        self.kernels[index].set_args(*[self.images[image] for image in bound], *self.extra_arguments)
        global_size = (spec["global_size"][0] if size is None else size,)
        local_size = tuple(spec["local_size"]) if spec.get("local_size") else None  # bundles before schedules
        try:
            return self.cl.enqueue_nd_range_kernel(self.queue, self.kernels[index], global_size, local_size,
                                                   global_work_offset=(offset,) if offset else None)
        except self.cl.LogicError as error:
            if local_size is None or "INVALID_WORK_GROUP_SIZE" not in str(error):
                raise
            raise BundleError(f"launch '{spec['name']}': {self.device.name} cannot run this kernel in work-groups of "
                              f"{local_size[0]} ({error})", "compile for a target with a smaller "
                              "max_work_group_size (a measured profile: fblc profile --device local)") from None


    def parameters(self) -> dict[str, np.ndarray]:
        """The trainable parameters now, by ONNX name and shape."""
        return {p["name"]: self._read(p["texture"]).astype(np.float32).reshape(p["shape"])
                for p in self.manifest["parameters"]}


#: language_standard stays importable from here (tests/test_group_reductions.py)
__all__ = ["DataError", "KernelBuildError", "LocalRunner", "STORAGES", "language_standard"]
