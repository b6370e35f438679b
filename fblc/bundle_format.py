"""The bundle format: file names, version, checksums. The one module both codegen and runtimes share.

A bundle is a directory:
- manifest.json  format name and version, fblc version, target, profile digest, dtype,
                 graph inputs/outputs, parameters and states (name, shape, dtype, texture,
                 offset in params.bin), and the sha256 of every other file; class-index labels
                 also carry `classes` and `ignore_index` (optional: a runtime that finds them
                 refuses other label values before training); parameters a torch export
                 named carry `torch_name` (and `torch_transposed`: true where the tensor is the
                 torch parameter with its last two axes swapped), for messages and saved files; a forward
                 bundle (`fblc compile --trainer none`) has `step`: "forward" and no `loss`: its step is
                 the model's forward, its outputs the model's (`fblc run --infer`); last, `manifest_sha256`: the
                 sha256 of the manifest file itself with that digest's 64 characters written
                 as zeros, so that an edit of any byte of any file the runtimes read is refused;
- plan.json      textures (width, height, format, lifetime) and the ordered kernel launches
                 (kernel name, global/local size, texture arguments, and the schedule its kernel
                 was built with: optional, for tools), the state swaps after a step (a state updated
                 in place, fblc.codegen.inplace, has none: its `.new` value names the state's own
                 texture, which a launch both reads and writes), and under dynamic
                 loss scaling `swaps_if_finite` {flag, pairs}: pairs swapped only after a step whose
                 flag texture (the metric `skipped`) reads 0 (fblc.passes.commit_if_finite); an ES step's
                 `loops` [{begin, end, count, swaps}]: launches begin..end-1 run `count` times, the
                 (carried, next) texture pairs of `swaps` exchanged after each repetition (ES members in a
                 loop, fblc.compiler.es_loop);
- kernels.cl     OpenCL C, one __kernel per launch, its textures image2d_t (what phones run);
- kernels.buffer.cl  the same kernels, their textures __global buffers of texels in index order
                 (LocalRunner's storage "buffer"); plan.json's launches give each kernel's lines in
                 both files (`lines`, `buffer_lines`);
- params.bin     initial texture contents (parameters, optimizer state, constants), each
                 already in its texture layout;
- report.json    what the compiler did (kernels per family, textures, bytes);
- factors.npz    (optional) an adapter's frozen factors by tensor name (MemFLoRA's P, FuRA-S's R), which
                 `fblc export` merges with the trained ones; manifest.json `export` names the source model
                 (path, sha256, bytes; its external data files: bytes and a sampled sha256) and the adapter's
                 sites (fblc.codegen.export_record). Runtimes ignore both. A bundle with an adapter also has
                 `fingerprint` (adapter, base-model digest, frozen factors' digest, seed, `id`), which the
                 runtimes compare with a specialist's before serving it (fblc.runtime.specialist).
Runtimes read exactly this and know nothing about ONNX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Sequence

import numpy as np

from fblc.errors import BundleError, FblcError  # kept as fmt.BundleError: the runtimes raise it and its subclasses

FORMAT_NAME = "fblc-bundle"
#: 2: texel layouts (rtile), shared images, r_mask4 textures; 3: r_mask8 textures; 4: manifest_sha256;
#: 5: plan.json `swaps_if_finite` (a runtime that ignored it would never commit those states); 6: plan.json `loops`
#: (ES members in a loop: a runtime that ignored it would run one member)
FORMAT_VERSION = 6
MANIFEST = "manifest.json"
PLAN = "plan.json"
KERNELS = "kernels.cl"
BUFFER_KERNELS = "kernels.buffer.cl"
PARAMS = "params.bin"
REPORT = "report.json"
FACTORS = "factors.npz"
CHECKSUMMED = (PLAN, KERNELS, BUFFER_KERNELS, PARAMS, REPORT)
#: manifest.json `step` of a forward bundle (--trainer none); a training bundle has none, and a `loss`
FORWARD_STEP = "forward"


def is_forward(manifest: dict[str, Any]) -> bool:
    """Whether the bundle's step is the model's forward alone (fblc run --infer), not a training step."""
    return manifest.get("step") == FORWARD_STEP


def value_of(plan: dict[str, Any], name: str, texture_value: np.ndarray) -> np.ndarray:
    """Value `name` of the step from its texture's tensor (`texture_value`, any shape: its elements in order): a
    remapped transpose or broadcast (plan.json `value_maps`), else a reshape of it or a prefix (`value_shapes`).
    LocalRunner.read and the native runner's outputs (runtime/native) both read a value through this."""
    strided = plan["value_maps"].get(name)
    flat = np.ascontiguousarray(texture_value).reshape(-1)
    if strided is not None:
        view = np.lib.stride_tricks.as_strided(flat[strided["offset"]:], shape=strided["shape"],
                                               strides=[s * flat.itemsize for s in strided["strides"]])
        return view.copy()
    shape = plan["value_shapes"].get(name, texture_value.shape)
    return flat[:int(np.prod(shape, dtype=np.int64))].reshape(shape)


#: the manifest's digest of itself (see the module docstring); the native runner finds it as this does
MANIFEST_DIGEST = "manifest_sha256"
_UNSEALED = "0" * 64
_DIGEST_FIELD = re.compile(rb'"manifest_sha256"[ \t\n\r]*:[ \t\n\r]*"([0-9a-f]{64})"')  # JSON's whitespace
#: files a runtime adds to a bundle folder (the native runner's program binaries); like the checksummed
#: ones, fblc wrote them, so compiling over the bundle may replace them without --force
RUNTIME_FILES = ("kernels.cache",)

# Texture formats: (OpenCL channel order, channel type) by the names the plan uses.
# r_mask8: a boolean tensor saved for the backward, one bit per element, 8 to a byte, LSB first
# (texel_layout "mask8"); r_mask4: its fallback, 4 elements in the low bits of a byte ("mask4").
# The image of an r_mask texture is sized in bytes (its image texels), its tensor in 4-element
# texels like every other's (what the kernels launch over).
TEXTURE_FORMATS = {"rgba_f32": ("RGBA", "FLOAT"), "rgba_f16": ("RGBA", "HALF_FLOAT"),
                   "rgba_i32": ("RGBA", "SIGNED_INT32"), "r_mask8": ("R", "UNSIGNED_INT8"),
                   "r_mask4": ("R", "UNSIGNED_INT8")}
TEXEL_BYTES = {"rgba_f32": 16, "rgba_f16": 8, "rgba_i32": 16, "r_mask8": 1, "r_mask4": 1}  # per image texel
#: the C element type of each format's texels in a buffer (LocalRunner's storage "buffer"; fp16: 4 halfs a texel)
BUFFER_C_TYPES = {"rgba_f32": "float4", "rgba_f16": "half", "rgba_i32": "int4", "r_mask8": "uchar", "r_mask4": "uchar"}
NUMPY_DTYPES = {"rgba_f32": "<f4", "rgba_f16": "<f2", "rgba_i32": "<i4", "r_mask8": "u1", "r_mask4": "u1"}
CHANNELS = {"rgba_f32": 4, "rgba_f16": 4, "rgba_i32": 4, "r_mask8": 1, "r_mask4": 1}
#: the r_mask format of each texel_layout mask kind
MASK_FORMATS = {"mask8": "r_mask8", "mask4": "r_mask4"}
#: the image format of a float tensor stored at each precision (`--dtype`, fblc.storage)
FLOAT_FORMATS = {"fp32": "rgba_f32", "fp16": "rgba_f16"}
INTEGER_FORMATS = ("rgba_i32", *MASK_FORMATS.values())  # read back as integers
#: the build option a runtime gives a device that lists cl_khr_fp16: the kernels.cl preamble then makes the half
#: kernels' `real` half (else float; a compiler's own cl_khr_fp16 macro is not enough: oclgrind 21.10 defines it
#: without read_imageh). The native runner's device.c defines the same (HALF_OPTION)
HALF_BUILD_OPTION = "-DFBLC_HALF"


#: bytes past a texture's texels in buffer storage: a window at a runtime shift (a vload4 in kernels.buffer.cl)
#: loads up to 3 elements past the texel that holds the tensor's last element (one fp32 texel of slack)
WINDOW_SLACK_BYTES = 16


def image_bytes(image_format: str, width: int, height: int) -> int:
    """Device bytes of a width x height image of a plan texture format (the one formula: compile's
    report, the memory plan's masks and both runtimes' allocations agree through it)."""
    return width * height * TEXEL_BYTES[image_format]


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def sealed_manifest(manifest: dict[str, Any]) -> bytes:
    """The text of manifest.json for `manifest`, its `manifest_sha256` field last: the digest of this very
    text with the field's value written as 64 zeros."""
    text = json.dumps({**manifest, MANIFEST_DIGEST: _UNSEALED}, indent=2).encode()
    start = text.rindex(f'"{MANIFEST_DIGEST}": "{_UNSEALED}"'.encode()) + len(MANIFEST_DIGEST) + 5
    return text[:start] + hashlib.sha256(text).hexdigest().encode() + text[start + len(_UNSEALED):]


def manifest_seal_holds(text: bytes) -> bool:
    """Whether the manifest file `text` holds one `manifest_sha256` field whose value is the sha256 of the
    text with that value written as zeros (sealed_manifest's)."""
    found = list(_DIGEST_FIELD.finditer(text))
    if len(found) != 1:
        return False
    start, end = found[0].span(1)
    return hashlib.sha256(text[:start] + _UNSEALED.encode() + text[end:]).hexdigest() == found[0].group(1).decode()


def load_manifest(bundle: str) -> dict[str, Any]:
    """The manifest of `bundle` after checking its format version and its own digest (not the other files'
    checksums: load_verified does, hashing params.bin)."""
    manifest_path = os.path.join(bundle, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise BundleError(f"'{bundle}' is not an fblc bundle: {MANIFEST} is missing; "
                          "compile one with 'fblc compile MODEL -o DIR'")
    try:
        with open(manifest_path, "rb") as handle:
            text = handle.read()
        manifest = json.loads(text)
    except (OSError, ValueError) as error:
        raise BundleError(f"{manifest_path} is unreadable ({error}); compile the bundle again") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{manifest_path} is not a JSON object; compile the bundle again")
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"'{bundle}' has format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                          f"this fblc reads {FORMAT_NAME} version {FORMAT_VERSION}: compile it again with this fblc")
    if not manifest_seal_holds(text):
        raise BundleError(f"'{manifest_path}' does not match its own checksum ({MANIFEST_DIGEST}): corrupt or "
                          "edited; compile the bundle again")
    return manifest


def load_verified(bundle: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, plan) of `bundle` after checking its format version and every checksum, the manifest's own."""
    manifest = load_manifest(bundle)
    for name in CHECKSUMMED:
        path = os.path.join(bundle, name)
        want = manifest.get("checksums", {}).get(name)
        if not os.path.isfile(path):
            raise BundleError(f"'{bundle}' is incomplete: {name} is missing; compile the bundle again")
        if want is None or sha256_of(path) != want:
            raise BundleError(f"'{bundle}/{name}' does not match the checksum in {MANIFEST} (corrupt or edited); "
                              "compile the bundle again")
    return manifest, read_json(os.path.join(bundle, PLAN))


def checked_rewards(values: Sequence[float], members: int) -> np.ndarray:
    """What an ES bundle's reward function (--reward external) answered, as its `rewards` input:
    float32 [members], or an error naming what is wrong with it."""
    rewards = np.asarray(values, dtype=np.float64).reshape(-1)
    if rewards.size != members:
        raise BundleError(f"the reward function returned {rewards.size} rewards for {members} members; "
                          "return one reward per member output, in the order given")
    if not np.isfinite(rewards).all():
        raise BundleError(f"the reward function returned a non-finite reward ({rewards.tolist()}); "
                          "return finite numbers, e.g. 1.0 for a solved task and 0.0 otherwise")
    return rewards.astype(np.float32)


def npz_tensors(path: str, option: str, remedy: str) -> dict[str, np.ndarray]:
    """The arrays of the .npz `path` (given as `option`, e.g. "--params") by name, or an FblcError naming the file
    (unreadable, not an .npz, one .npy array) with `remedy`: trained parameters and specialists are such files."""
    try:
        data = np.load(path, allow_pickle=False)
    except OSError as error:
        raise FblcError(f"cannot read {option} '{path}' ({error.strerror or error})", remedy) from None
    except ValueError:  # numpy's guess for bytes that are no .npy/.npz: pickled data
        raise FblcError(f"{option} '{path}' is not an .npz file", remedy) from None
    if not isinstance(data, np.lib.npyio.NpzFile):  # a single .npy array
        raise FblcError(f"{option} '{path}' is one .npy array, not an .npz of tensors by name", remedy)
    with data:
        return {key: data[key] for key in data.files}
