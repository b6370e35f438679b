"""The arena: every texture of a program at a byte offset of one device buffer, textures whose lifetimes
overlap at disjoint ranges (plan.json's `arena`, docs/ARCHITECTURE.md §4).

Textures of any format, width and height share memory here, which the shared images of one format and width
(plan.buffer_table's `images`) cannot. Buffer storage (kernels.buffer.cl) binds each texture to a sub-buffer of
the arena (OpenCL 1.1's clCreateSubBuffer, which every device has); image storage binds it to an image created
over its sub-buffer where the target has cl_khr_image2d_from_buffer (its profile's `image2d_from_buffer`),
else the runtimes allocate the shared images instead. A texture's slot holds both views: its image rows at a
pitch of a multiple of `image_pitch_alignment` bytes (when the target has the extension) and its texels in index order with
the buffer kernels' window slack after them.

Offsets are chosen greedily, the textures kept over the whole step first (parameters, states, inputs), then the
largest slot first, each at the lowest aligned offset free of every slot placed so far whose lifetime overlaps
(the greedy-by-size offset assignment of TFLite's memory planner): for a step's textures it comes within a few
percent of the most bytes live at one launch, the bound no placement beats (MemFLoRA MobileNetV2 B=64 r=2
adreno830: 32.55 MiB for 32.02 MiB live; largest first alone gave 33.01, first use first 38.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from fblc.bundle_format import TEXEL_BYTES, WINDOW_SLACK_BYTES, image_bytes
from fblc.codegen.textures import Texture
from fblc.profiles import Profile

Lifetime = tuple[int, int]  # (first, last) kernel that reads or writes a texture


@dataclass
class Arena:
    """Each texture's slot (offset, bytes) and image row pitch in one buffer of `bytes` bytes."""

    bytes: int
    alignment: int  # every offset is a multiple of it
    offsets: list[int]  # by texture id
    slots: list[int]  # by texture id: bytes of the texture's range
    pitches: list[int]  # by texture id: row pitch (bytes) of the image over its slot; 0: the target has no such image
    live_bytes: int  # the most slot bytes live at one launch: what no placement can beat

    def plan_object(self, images: bool) -> dict[str, Any]:
        """plan.json's `arena` (the textures' offsets, slots and pitches are in their own entries)."""
        return {"bytes": self.bytes, "alignment": self.alignment, "images": images}


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def slot_of(texture: Texture, profile: Profile, alignment: int) -> tuple[int, int]:
    """(slot bytes, image row pitch) of `texture`: room for its texels in index order and a window's slack past
    them (buffer storage), and where the target makes images over buffers, its rows at an aligned pitch."""
    flat = image_bytes(texture.format, texture.width, texture.height) + WINDOW_SLACK_BYTES
    if not profile.image2d_from_buffer:
        return _round_up(flat, alignment), 0
    pitch = _round_up(texture.width * TEXEL_BYTES[texture.format], profile.image_pitch_alignment)
    return _round_up(max(flat, pitch * texture.height), alignment), pitch


def alignment_of(profile: Profile) -> int:
    """The offsets' common multiple: a sub-buffer's origin (base_address_alignment) and, where images are made
    over slots, an image's first pixel (image_pitch_alignment)."""
    if profile.image2d_from_buffer:
        return int(np.lcm(profile.base_address_alignment, profile.image_pitch_alignment))
    return profile.base_address_alignment


def pack_arena(textures: Sequence[Texture], lifetimes: Sequence[Lifetime], profile: Profile) -> Arena:
    """Offsets for `textures` (lifetimes by texture id: a texture the runtimes keep across steps or read outside
    them has the whole step, (0, last launch)) such that two whose lifetimes overlap never share a byte."""
    alignment = alignment_of(profile)
    slots, pitches = zip(*(slot_of(t, profile, alignment) for t in textures)) if textures else ((), ())
    count = len(textures)
    first = np.array([lifetime[0] for lifetime in lifetimes], dtype=np.int64)
    last = np.array([lifetime[1] for lifetime in lifetimes], dtype=np.int64)
    size = np.array(slots, dtype=np.int64)
    start = np.zeros(count, dtype=np.int64)
    placed = np.zeros(count, dtype=bool)
    whole = (first <= 0) & (last >= (last.max() if count else 0))  # kept over the whole step: at the bottom, packed
    order = sorted(range(count), key=lambda t: (not whole[t], -slots[t], first[t], t))
    # the whole-step textures come first and overlap every texture: each lands on the previous one's end, and the
    # later ones' search starts above them all (one interval, not hundreds: 969 of the 1B LoRA step's 2,966 textures)
    bottom = order[:int(whole.sum())]
    start[bottom] = np.cumsum(size[bottom]) - size[bottom]
    floor = int(size[bottom].sum())
    for index in order[len(bottom):]:
        overlapping = placed & (first <= last[index]) & (last >= first[index])
        taken = sorted(zip(start[overlapping].tolist(), (start + size)[overlapping].tolist()))
        offset = floor
        for begin, end in taken:  # the lowest gap that holds the slot
            if begin - offset >= slots[index]:
                break
            offset = max(offset, end)
        start[index], placed[index] = offset, True
    total = int((start + size).max()) if count else 0
    steps = int(last.max()) + 1 if count else 0
    live = np.zeros(max(steps, 1), dtype=np.int64)
    for index in range(count):
        live[first[index]:last[index] + 1] += size[index]
    return Arena(total, alignment, start.tolist(), list(slots), list(pitches), int(live.max()))
