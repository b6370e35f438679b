"""Specialists: the adapter tensors of a forward bundle with adapter sites, replaced at run time.

`fblc compile MODEL --trainer none --adapter lora|memflora|fura-s` writes a forward bundle whose manifest lists
the adapter's trained tensors under `specialist` (LoRA's A and B, MemFLoRA's U, FuRA-S's delta), each the root
of a texture that params.bin fills with the adapter's identity (B, U, delta zero: the base model's forward).
A specialist is an .npz of those tensors by name, what `fblc export BUNDLE --params trained.npz --keep-adapters
FILE.npz` writes for the training bundle compiled with the same adapter options. Loading one writes those
textures and nothing else: the frozen weights, and MemFLoRA's P / FuRA-S's R (made at compile time from --seed
and from the weights) stay shared. Both runtimes check it here first: every site present with its shape, nothing
else (a tensor of another adapter or rank would be silently wrong otherwise).
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.texel_layout import TexelLayout, pack

#: the native runner's --specialist file: magic, u32 count, then per texture u32 id, u64 bytes, its packed texels
SPECIALIST_MAGIC = b"FBLCSPEC"


def sites(manifest: Mapping[str, Any], bundle: str) -> list[dict[str, Any]]:
    """The bundle's adapter sites (manifest `specialist`), or an error saying it has none."""
    entries = manifest.get("specialist")
    if not entries:
        raise FblcError(f"'{bundle}' has no adapter sites, so it takes no specialist",
                        "compile the model with --trainer none --adapter KIND (the adapter the specialist "
                        "was trained with, with the same --rank/--seed/--block)")
    return entries


def checked(manifest: Mapping[str, Any], bundle: str, tensors: Mapping[str, Any], source: str) -> dict[str, np.ndarray]:
    """`tensors` (from `source`, a file name or "the specialist") as float32 arrays by site name, after checking that
    they are the bundle's sites exactly: a missing, extra or misshapen tensor is refused by name."""
    entries = sites(manifest, bundle)
    expected = {e["name"]: list(e["shape"]) for e in entries}
    remedy = ("give the file 'fblc export TRAINING_BUNDLE --params trained.npz --keep-adapters FILE.npz' wrote, for a "
              "training bundle compiled with the adapter options of this one")
    for name, shape in expected.items():
        if name not in tensors:
            raise FblcError(f"{source} has no tensor '{name}', an adapter site of '{bundle}' (shape {shape})", remedy)
        given = list(np.shape(tensors[name]))
        if given != shape:
            raise FblcError(f"tensor '{name}' of {source} has shape {given}; the adapter site of '{bundle}' has "
                            f"shape {shape}", remedy)
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise FblcError(f"{source} holds {len(extra)} tensor(s) that are no adapter site of '{bundle}', e.g. "
                        f"'{extra[0]}'", remedy)
    arrays = {name: np.asarray(tensors[name], np.float32) for name in expected}
    bad = next((name for name, array in arrays.items() if not np.isfinite(array).all()), None)
    if bad is not None:
        raise FblcError(f"tensor '{bad}' of {source} holds non-finite values", remedy)
    return arrays


def load_file(path: str) -> dict[str, np.ndarray]:
    """The arrays of the specialist .npz `path` by name, or an error naming the file."""
    return fmt.npz_tensors(path, "--specialist",
                           "give the .npz file 'fblc export BUNDLE --params trained.npz --keep-adapters FILE.npz' wrote")


def image_layout(texture: Mapping[str, Any]) -> TexelLayout:
    """Where a texture's texels sit in its image (plan.json), as params.bin packs them."""
    if "layout" in texture:
        return TexelLayout.from_dict(texture["layout"])
    return TexelLayout("flat", texture["width"], texture["height"])


def packed(plan: Mapping[str, Any], entry: Mapping[str, Any], array: np.ndarray) -> bytes:
    """A site's tensor as its texture's image texels, byte for byte what params.bin holds for it."""
    texture = plan["textures"][entry["texture"]]
    return pack(array, image_layout(texture), fmt.NUMPY_DTYPES[texture["format"]]).tobytes()


def write_native(path: str, manifest: Mapping[str, Any], plan: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
                 ) -> int:
    """The native runner's --specialist file for `arrays` (checked): each site's packed texels by texture id,
    which the runner writes over the texture's initial data. Returns the texel bytes it holds."""
    records = [(entry["texture"], packed(plan, entry, arrays[entry["name"]])) for entry in manifest["specialist"]]
    with open(path, "wb") as handle:
        handle.write(SPECIALIST_MAGIC + struct.pack("<I", len(records)))
        for texture, data in records:
            handle.write(struct.pack("<IQ", texture, len(data)) + data)
    return sum(len(data) for _, data in records)


def site_bytes(manifest: Mapping[str, Any]) -> int:
    """Bytes of the adapter sites' textures as params.bin holds them (what a specialist replaces)."""
    return sum(int(entry["nbytes"]) for entry in manifest.get("specialist", []))
