"""The buffer table: every texture of a program with its lifetime, and the images they share, as the
memory report (`allocated_bytes`) and plan.json (`images`, which both runtimes allocate) give them.

Pinned textures keep an image of their own: the runtimes read or write them (graph inputs and outputs,
the loss), they carry initial data (parameters, constants) or state across steps (the swapped pairs).
The others share: textures of one format and width whose lifetimes do not overlap take one image, as
tall as the tallest of them (a texture's texels sit at the same places in a taller image of its width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from fblc import bundle_format as fmt
from fblc.codegen.plan import Program
from fblc.codegen.textures import Texture

Lifetime = tuple[int, int]  # (first, last) kernel that reads or writes a texture; (-1, -1): none does


@dataclass
class BufferTable:
    """A texture is the buffer here; the memory plan's buffers (fblc.passes.memory_plan.Buffer) are
    the step graph's values before they became textures."""

    textures: list[Texture]  # by texture id
    lifetimes: list[Lifetime]  # by texture id
    images: list[dict[str, Any]]  # plan.json's images: format, width, height, textures
    image_of: list[int]  # texture id -> image

    @property
    def texture_bytes(self) -> int:
        """Every texture in an image of its own."""
        return sum(t.image_bytes for t in self.textures)

    @property
    def allocated_bytes(self) -> int:
        """What the runtimes allocate: the shared images."""
        return sum(fmt.image_bytes(i["format"], i["width"], i["height"]) for i in self.images)


def buffer_table(model: ir.Model, program: Program) -> BufferTable:
    """The program's textures with their lifetimes and the images they share by the rule of the module
    docstring (unused textures keep an image of their own)."""
    uses: dict[int, list[int]] = {}  # texture id -> the kernels that read or write it
    for index, kernel in enumerate(program.kernels):
        for texture_id in kernel.outputs + kernel.inputs:
            uses.setdefault(texture_id, []).append(index)
    lifetimes = [(uses[t.id][0], uses[t.id][-1]) if t.id in uses else (-1, -1) for t in program.textures]
    outside = list(model.graph.inputs) + list(model.graph.outputs)
    pinned = (set(program.initial) | {t for pair in program.swaps for t in pair} | {program.values["loss"]}
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
    return BufferTable(program.textures, lifetimes, images, image_of)
