"""Device memory of a LocalRunner: its textures as views of plan.json's arena or as plan.json's shared images.

The compiler gave every texture a slot in one arena (fblc/codegen/arena.py) and, as the fallback, an image it
shares with textures of one format and width whose lifetimes are disjoint (plan.json `images`). Where the device
allows it (arena_problem), the runner makes one buffer and binds each texture to a view of its slot: a sub-buffer
in buffer storage, an image over the sub-buffer (cl_khr_image2d_from_buffer) in image storage. Elsewhere it
allocates plan.json's images exactly as listed. The native runner chooses alike (runner.c, arena_problem).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from fblc import bundle_format as fmt

#: one fp32 texel of slack past every buffer: a window at a runtime shift (a vload4 in kernels.buffer.cl) loads up
#: to 3 elements past the texel that holds the tensor's last element
WINDOW_SLACK_BYTES = fmt.WINDOW_SLACK_BYTES


def image_format(cl: Any, name: str) -> Any:
    order, channel = fmt.TEXTURE_FORMATS[name]
    return cl.ImageFormat(getattr(cl.channel_order, order), getattr(cl.channel_type, channel))


#: clGetDeviceInfo's queries of cl_khr_image2d_from_buffer (CL_DEVICE_IMAGE_PITCH_ALIGNMENT_KHR, ..._BASE_ADDRESS_...)
IMAGE_PITCH_ALIGNMENT, IMAGE_BASE_ADDRESS_ALIGNMENT = 0x104A, 0x104B


def arena_problem(plan: Mapping[str, Any], device: Any, storage: str) -> str:
    """Why a runner with `storage` on `device` cannot bind the textures to views of plan.json's arena (codegen/
    arena.py), "" where it can: buffers need a sub-buffer origin the device allows at every offset; images also
    need cl_khr_image2d_from_buffer, a plan that made its slots for images, and the device's pitch alignment."""
    import pyopencl as cl

    arena = plan.get("arena")
    if arena is None:
        return "the bundle has no arena"
    name = device.name.strip()
    if arena["alignment"] % max(1, device.mem_base_addr_align // 8):
        return (f"{name} aligns sub-buffers to {device.mem_base_addr_align // 8} bytes, the plan's arena to "
                f"{arena['alignment']}")
    if storage == "buffer":
        return ""
    if "cl_khr_image2d_from_buffer" not in str(device.extensions).split():
        return f"{name} lacks cl_khr_image2d_from_buffer"
    if not arena.get("images"):
        return "the bundle was compiled for a target without images over buffers (its profile's image2d_from_buffer)"
    try:  # pyopencl names neither query: their values from cl_khr_image2d_from_buffer
        pixels = max(device.get_info(IMAGE_PITCH_ALIGNMENT), device.get_info(IMAGE_BASE_ADDRESS_ALIGNMENT), 1)
    except cl.Error:  # a wrapper or driver that answers neither: LocalRunner tries to make the images, else falls back
        return ""
    texels = {t["format"]: fmt.TEXEL_BYTES[t["format"]] for t in plan["textures"]}
    strict = [f for f, size in texels.items() if arena["alignment"] % (pixels * size)
              or any(t["pitch"] % (pixels * size) for t in plan["textures"] if t["format"] == f)]
    if strict:
        return f"{name} aligns image rows to {pixels} pixels, more than the plan's {', '.join(strict)} rows have"
    return ""


def overlapping(textures: Sequence[Mapping[str, Any]]) -> set[int]:
    """The textures whose arena slot another texture uses after their first use in a step (lifetimes disjoint):
    their values are gone after the step. A texture whose slot only earlier ones used (an output such as a
    gradient, which holds its slot from its writer to the step's end) keeps its value until the next step."""
    start = np.array([t["offset"] for t in textures], dtype=np.int64)
    end = start + np.array([t["slot"] for t in textures], dtype=np.int64)
    overlap = (start[:, None] < end[None, :]) & (start[None, :] < end[:, None])
    np.fill_diagonal(overlap, False)
    if all("lifetime" in t for t in textures):
        first = np.array([t["lifetime"][0] for t in textures], dtype=np.int64)
        last = np.array([t["lifetime"][1] for t in textures], dtype=np.int64)
        overlap &= ~((last[None, :] < first[:, None]) & (last[None, :] >= 0))  # only used before: harmless
    return {textures[i]["id"] for i in np.flatnonzero(overlap.any(axis=1))}


@dataclass
class DeviceTextures:
    """A runner's allocations and how its textures sit in them."""

    images: list[Any]  # the memory objects the kernels are given: a view per texture, or the shared images
    binding: list[int]  # texture id -> its entry of `images` (the runner swaps entries per step)
    shared: set[int]  # textures whose memory another texture also uses in a step
    allocations: list[Any]  # what was allocated: the arena, or the shared images
    arena_reason: str  # why the textures are not views of the arena ("" where they are)


def _allocate(cl: Any, context: Any, storage: str, spec: Mapping[str, Any]) -> Any:
    """One of plan.json's shared images: a buffer of its texels (and the window slack) or an image."""
    if storage == "buffer":
        return cl.Buffer(context, cl.mem_flags.READ_WRITE,
                         fmt.image_bytes(spec["format"], spec["width"], spec["height"]) + WINDOW_SLACK_BYTES)
    return cl.create_image(context, cl.mem_flags.READ_WRITE, image_format(cl, spec["format"]),
                           shape=(spec["width"], spec["height"]))


def _view(cl: Any, context: Any, storage: str, arena: Any, texture: Mapping[str, Any]) -> Any:
    """The texture's slot of the arena: a sub-buffer, or in image storage an image over it
    (cl_khr_image2d_from_buffer) with the plan's row pitch."""
    region = arena.get_sub_region(texture["offset"], texture["slot"])
    if storage == "buffer":
        return region
    desc = cl.ImageDescriptor()
    desc.image_type = cl.mem_object_type.IMAGE2D
    desc.shape = (texture["width"], texture["height"])
    desc.pitches = (texture["pitch"],)
    desc.buffer = region
    return cl.Image(context, cl.mem_flags.READ_WRITE, image_format(cl, texture["format"]), desc=desc)


def allocate_textures(cl: Any, context: Any, device: Any, plan: Mapping[str, Any], storage: str) -> DeviceTextures:
    """The plan's textures on `device`: views of one arena buffer where arena_problem finds none and the driver
    makes every view, else plan.json's shared images."""
    textures = plan["textures"]
    reason = arena_problem(plan, device, storage)
    if not reason:  # one buffer; each texture a view of its slot (image or sub-buffer)
        arena = cl.Buffer(context, cl.mem_flags.READ_WRITE, plan["arena"]["bytes"])
        try:
            views = [_view(cl, context, storage, arena, t) for t in textures]
        except cl.Error as error:  # e.g. a row pitch the driver refuses, where it did not say its alignment
            reason = f"{device.name.strip()} refused a view of the arena: {error}"
            arena.release()
        else:
            return DeviceTextures(views, [t["id"] for t in textures], overlapping(textures), [arena], "")
    specs = plan["images"]  # textures with disjoint lifetimes share an image, allocated as listed
    images = [_allocate(cl, context, storage, spec) for spec in specs]
    binding = [t["image"] for t in textures]
    shared = {t["id"] for t in textures if len(specs[binding[t["id"]]]["textures"]) > 1}
    return DeviceTextures(images, binding, shared, images, reason)
