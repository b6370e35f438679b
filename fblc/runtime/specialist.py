"""Specialists: the adapter tensors of a forward bundle with adapter sites, replaced at run time.

`fblc compile MODEL --trainer none --adapter lora|memflora|fura-s` writes a forward bundle whose manifest lists
the adapter's trained tensors under `specialist` (LoRA's A and B, MemFLoRA's U, FuRA-S's delta), each the root
of a texture that params.bin fills with the adapter's identity (B, U, delta zero: the base model's forward).
A specialist is an .npz of those tensors by name, what `fblc export BUNDLE --params trained.npz --keep-adapters
FILE.npz` writes for the training bundle compiled with the same adapter options. Loading one writes those
textures and nothing else: the frozen weights, and MemFLoRA's P / FuRA-S's R (made at compile time from --seed
and from the weights) stay shared. Both runtimes check it here first: every site present with its shape, nothing
else (a tensor of another adapter or rank would be silently wrong otherwise).

Names and shapes do not say which frozen factors and base weights the tensors were trained against: a MemFLoRA U
trained with another --seed (another P), a FuRA-S delta or LoRA A/B trained on other base weights (another R,
another W) fit and serve wrong outputs. So a specialist file carries its training bundle's `fingerprint`
(fblc.codegen.export_record.adapter_fingerprint) as the JSON bytes of the entry FINGERPRINT, and `checked` refuses
one that differs from the served bundle's, naming what differs; a file without one (written before fingerprints)
loads with a warning. The native runner's file carries the fingerprint's id, which the runner compares too.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any, Mapping

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.texel_layout import TexelLayout, pack

#: the native runner's --specialist file: magic, u32 length and the bytes of the fingerprint's id (0: none), u32
#: count, then per texture u32 id, u64 bytes, its packed texels (runner 5's "FBLCSPEC" had no fingerprint)
SPECIALIST_MAGIC = b"FBLCSPC2"
#: the .npz entry that holds a specialist's fingerprint (uint8, the JSON text), beside its tensors
FINGERPRINT = "__fblc_fingerprint__"


class Specialist(dict[str, np.ndarray]):
    """A specialist's tensors by name, with the fingerprint it carries (None: none) and the file it came from
    (None: given in memory, or already checked, so a missing fingerprint is not warned about again). A dict, so
    that every caller that takes tensors by name (LocalRunner.load_specialist among them) takes it unchanged."""

    def __init__(self, tensors: Mapping[str, np.ndarray], fingerprint: dict[str, Any] | None,
                 path: str | None = None) -> None:
        super().__init__(tensors)
        self.fingerprint: dict[str, Any] | None = fingerprint
        self.path: str | None = path


def with_fingerprint(tensors: Mapping[str, np.ndarray], fingerprint: Mapping[str, Any] | None
                     ) -> dict[str, np.ndarray]:
    """The entries of a specialist .npz: `tensors` and, where the training bundle records one, its fingerprint."""
    if fingerprint is None:
        return dict(tensors)
    return {**tensors, FINGERPRINT: np.frombuffer(json.dumps(dict(fingerprint), sort_keys=True).encode(), np.uint8)}


def _split(tensors: Mapping[str, Any], source: str) -> Specialist:
    """`tensors` without the FINGERPRINT entry, the fingerprint decoded (an unreadable one refused by name)."""
    if isinstance(tensors, Specialist):
        return tensors
    if FINGERPRINT not in tensors:
        return Specialist(tensors, None)
    try:
        fingerprint = json.loads(np.asarray(tensors[FINGERPRINT], np.uint8).tobytes().decode())
        if not isinstance(fingerprint, dict) or not isinstance(fingerprint.get("id"), str):
            raise ValueError
    except (ValueError, TypeError):
        raise FblcError(f"the entry '{FINGERPRINT}' of {source} is not a fingerprint that fblc export wrote",
                        "export the specialist again with 'fblc export --keep-adapters'") from None
    return Specialist({k: v for k, v in tensors.items() if k != FINGERPRINT}, fingerprint)


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)  # sys.stderr looked up now: pytest may replace it


def _short(digest: str) -> str:
    return digest[:12]


def fingerprint_problem(served: Mapping[str, Any], given: Mapping[str, Any], bundle: str, source: str
                        ) -> tuple[str, str] | None:
    """(what differs, what to do) between the fingerprint of `source` and the served bundle's, or None: the adapter,
    then the base model (other weights also make FuRA-S's R differ), the seed, last the factors themselves."""
    if given["id"] == served.get("id"):
        return None
    kind = served.get("adapter")
    if given.get("adapter") != kind:
        return (f"{source} was trained with the adapter {given.get('adapter')}; '{bundle}' has {kind} sites",
                f"compile the served bundle with --adapter {given.get('adapter')}")
    if given.get("base_sha256") != served.get("base_sha256"):
        return (f"{source} was trained on other base weights ('{given.get('model')}', digest "
                f"{_short(str(given.get('base_sha256')))}) than '{bundle}' was compiled from ('{served.get('model')}', "
                f"digest {_short(str(served.get('base_sha256')))})",
                "serve it from a bundle compiled from the model it was trained on, or train the specialist again "
                "on this bundle's model")
    if given.get("seed") != served.get("seed"):
        return (f"the frozen projection {source} was trained against was drawn with --seed {given.get('seed')}; "
                f"'{bundle}' was compiled with --seed {served.get('seed')}",
                f"compile the served bundle with --seed {given.get('seed')} (the seed of the training bundle)")
    return (f"the frozen factors {source} was trained against (digest {_short(str(given.get('frozen_sha256')))}) are "
            f"not those of '{bundle}' (digest {_short(str(served.get('frozen_sha256')))}), same model and seed",
            "compile the served bundle with the fblc and adapter options (--rank, --block) of the training bundle")


def _check_fingerprint(manifest: Mapping[str, Any], bundle: str, given: Specialist, source: str) -> None:
    """Refuse a specialist trained against other frozen factors or base weights; warn where one side has no
    fingerprint to compare (a file or bundle from before fingerprints)."""
    served = manifest.get("fingerprint")
    if given.fingerprint is None:
        if given.path is not None and served is not None:
            _warn(f"{source} carries no fingerprint (written before fblc recorded them), so whether it was trained "
                  f"on the base weights and frozen factors of '{bundle}' is not checked; export it again with "
                  "'fblc export TRAINING_BUNDLE --params trained.npz --keep-adapters FILE.npz'")
        return
    if served is None:
        _warn(f"'{bundle}' records no fingerprint (compiled before fblc recorded them), so whether {source} was "
              "trained on its base weights and frozen factors is not checked; compile it again")
        return
    problem = fingerprint_problem(served, given.fingerprint, bundle, source)
    if problem is not None:
        raise FblcError(*problem)


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
    they are the bundle's sites exactly: a missing, extra or misshapen tensor is refused by name, and so is one
    whose fingerprint is not the bundle's. The result carries the fingerprint on (for write_native)."""
    entries = sites(manifest, bundle)
    carried = _split(tensors, source)
    _check_fingerprint(manifest, bundle, carried, source)
    tensors = carried
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
    arrays = Specialist({name: np.asarray(tensors[name], np.float32) for name in expected}, carried.fingerprint)
    bad = next((name for name, array in arrays.items() if not np.isfinite(array).all()), None)
    if bad is not None:
        raise FblcError(f"tensor '{bad}' of {source} holds non-finite values", remedy)
    return arrays


def load_file(path: str) -> Specialist:
    """The arrays of the specialist .npz `path` by name, with the fingerprint it carries, or an error naming the
    file."""
    entries = fmt.npz_tensors(path, "--specialist",
                              "give the .npz file 'fblc export BUNDLE --params trained.npz --keep-adapters FILE.npz' "
                              "wrote")
    loaded = _split(entries, f"specialist '{path}'")
    loaded.path = path
    return loaded


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
    """The native runner's --specialist file for `arrays` (checked): the id of the fingerprint they carry (which
    the runner compares with the bundle's), then each site's packed texels by texture id, which the runner writes
    over the texture's initial data. Returns the texel bytes it holds."""
    records = [(entry["texture"], packed(plan, entry, arrays[entry["name"]])) for entry in manifest["specialist"]]
    fingerprint = getattr(arrays, "fingerprint", None)
    identity = fingerprint["id"].encode() if fingerprint is not None else b""
    with open(path, "wb") as handle:
        handle.write(SPECIALIST_MAGIC + struct.pack("<I", len(identity)) + identity + struct.pack("<I", len(records)))
        for texture, data in records:
            handle.write(struct.pack("<IQ", texture, len(data)) + data)
    return sum(len(data) for _, data in records)


def site_bytes(manifest: Mapping[str, Any]) -> int:
    """Bytes of the adapter sites' textures as params.bin holds them (what a specialist replaces)."""
    return sum(int(entry["nbytes"]) for entry in manifest.get("specialist", []))
