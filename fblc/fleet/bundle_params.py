"""A bundle's trainable tensors (and states) read from and written into params.bin's bytes, without OpenCL.

A fleet round moves the trainable arrays, by ONNX name, between the server and its clients. The server reads
the bundle's initial values from params.bin (the texels of each texture's layout, `manifest.parameters[i]` at
`offset`); a client whose device is reached over adb hands the runner a params.bin of the same size and
offsets holding the round's global model (`fblc-runner --params`), so the pushed bundle, its checksums and its
kernel cache stay as they are. A global model whose names or shapes are not the bundle's is refused naming the
first difference: averaging it in would corrupt the round.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.texel_layout import TexelLayout, pack, unpack


class ModelMismatch(FblcError):
    """A global model that does not fit the bundle a client trains."""


def _layout(texture: Mapping[str, Any]) -> TexelLayout:
    return (TexelLayout.from_dict(texture["layout"]) if "layout" in texture
            else TexelLayout("flat", texture["width"], texture["height"]))


def _entries(manifest: Mapping[str, Any], states: bool) -> list[Mapping[str, Any]]:
    return list(manifest["parameters"]) + (list(manifest.get("states", [])) if states else [])


def read_tensors(bundle: str, states: bool = False) -> dict[str, np.ndarray]:
    """The trainable tensors' initial values (with `states`, also the step's states: ES's `es.iteration`)."""
    manifest, plan = fmt.load_verified(bundle)
    with open(os.path.join(bundle, fmt.PARAMS), "rb") as handle:
        raw = handle.read()
    out = {}
    for entry in _entries(manifest, states):
        texture = plan["textures"][entry["texture"]]
        data = np.frombuffer(raw, dtype=fmt.NUMPY_DTYPES[texture["format"]], count=entry["nbytes"] // np.dtype(
            fmt.NUMPY_DTYPES[texture["format"]]).itemsize, offset=entry["offset"])
        size = int(np.prod(entry["shape"], dtype=np.int64))
        out[entry["name"]] = unpack(data, _layout(texture), size).astype(np.float32).reshape(entry["shape"])
    return out


def check_global(manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray], what: str = "the global model"
                 ) -> None:
    """Refuse `arrays` unless they are exactly the bundle's trainable tensors, by name and shape."""
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
    entries = {e["name"]: e for e in _entries(manifest, states=True)}
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
