"""A round's tensors written into a bundle's params.bin, and a client's reply checked against the bundle.

A client whose device is reached over adb hands the runner a params.bin of the bundle's size and offsets holding
the round's global model (`fblc-runner --params`: the texels of each texture's layout, `manifest.parameters[i]`
at `offset`), so the pushed bundle, its checksums and its program cache stay as they are (reading params.bin is
fblc.fleet.trainers.initial_tensors). The server refuses a reply whose tensors are not the bundle's trainable
ones by name and shape, or not finite, naming the first difference: averaging it in would corrupt the round.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.texel_layout import TexelLayout, pack


class ModelMismatch(FblcError):
    """A global model that does not fit the bundle a client trains."""


def _layout(texture: Mapping[str, Any]) -> TexelLayout:
    return (TexelLayout.from_dict(texture["layout"]) if "layout" in texture
            else TexelLayout("flat", texture["width"], texture["height"]))


def check_tensors(manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray], what: str) -> None:
    """Refuse `arrays` unless they are exactly the bundle's trainable tensors, by name and shape, and finite."""
    expected = {p["name"]: tuple(p["shape"]) for p in manifest["parameters"]}
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has {', '.join(extra)}, which the bundle "
                                                                       "does not train"] if extra else [])
        raise ModelMismatch(f"{what} {' and '.join(parts)}",
                            "the server and every client must use bundles compiled from one model with one "
                            "--adapter/--train choice")
    for name, shape in expected.items():
        got = tuple(np.shape(arrays[name]))
        if got != shape:
            raise ModelMismatch(f"{what}'s tensor '{name}' is {list(got)}, the bundle trains {list(shape)}",
                                "the server and every client must use bundles compiled from one model")
        if not np.all(np.isfinite(arrays[name])):
            raise ModelMismatch(f"{what}'s tensor '{name}' holds values that are not finite")


def params_bin(bundle: str, values: Mapping[str, np.ndarray]) -> bytes:
    """The bundle's params.bin with `values` (trainable tensors and states by name) in place of their initial
    values; every other texture's bytes as they are."""
    manifest, plan = fmt.load_verified(bundle)
    with open(os.path.join(bundle, fmt.PARAMS), "rb") as handle:
        raw = bytearray(handle.read())
    entries = {e["name"]: e for e in [*manifest["parameters"], *manifest.get("states", [])]}
    for name, value in values.items():
        if name not in entries:
            raise ModelMismatch(f"the bundle {bundle} has no parameter or state '{name}'")
        entry = entries[name]
        texture = plan["textures"][entry["texture"]]
        data = pack(np.asarray(value, np.float32), _layout(texture), fmt.NUMPY_DTYPES[texture["format"]]).tobytes()
        if len(data) != entry["nbytes"]:  # the manifest and the plan disagree: a damaged bundle
            raise ModelMismatch(f"'{name}' packs into {len(data)} bytes, the bundle's params.bin holds "
                                f"{entry['nbytes']}")
        raw[entry["offset"]:entry["offset"] + len(data)] = data
    return bytes(raw)
