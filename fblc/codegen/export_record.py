"""What `fblc export` needs from a bundle, recorded when it is compiled (manifest.json `export`, factors.npz).

The bundle's own tensors are texture contents in device layouts, and its step is fused kernels: neither gives
back the model's graph. So the bundle records which model it was compiled from (its absolute path, the sha256
and size of the .onnx file, and of each external data file its size and a sampled digest: the export reads
the graph and the frozen weights there and refuses files that changed) and what the adapter made of it: the
sites (the pass metadata, fblc.adapter or fblc.fura_s) and the frozen factors the merge needs, which the
compiler drew or computed and the trained parameters lack (MemFLoRA's P, FuRA-S's block right singular vectors
R): factors.npz, checksummed like the other files.
A copy of the model is not kept: it would double a bundle of a large model.

External data is not hashed whole: a 1B model's 6 GB cost ~4 CPU s of sha256 (and the reads) at every compile,
a fifth of issue 40's 20 s budget, for a check only `fblc export` makes. Its digest (`sampled_sha256`) covers the
file's size and, for every tensor stored there (the span from its offset to the next tensor's or the end of the
file), SAMPLE_PAGES pages spread evenly over the span, its first and last included; a span of at most that many
pages is read whole. So the export refuses data of another size, a re-exported or retrained model (every weight
differs), and any change to a small tensor (norm weights, biases) or to a large tensor's sampled pages; an edit
confined to unsampled pages of a large tensor passes. The .onnx file itself (the graph, which fixes the spans) is
hashed whole.

A bundle with an adapter also records its `fingerprint` (manifest.json, read by both runtimes; adapter_fingerprint):
what a specialist's tensors mean depends on besides their names and shapes, which `fblc export --keep-adapters`
writes into the specialist and a forward bundle compares before serving it: the adapter kind, the base model
(the digests above, not the path: a copy of the model serves the same specialists), the frozen factors' values
(MemFLoRA's P drawn from --seed, FuRA-S's R from the weights' SVD; hashed at float16 precision, so that an fp16
bundle's rounded copy of the same factors agrees with an fp32 one) and, where a factor was drawn, the seed (for
the message: the factors' digest already decides).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any

import numpy as np
import onnx_ir as ir

from fblc import bundle_format as fmt
from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.model_io import external_data_offsets

#: the pass metadata that describes each kind of adapter sites, and the frozen factor each site names
ADAPTER_METADATA = {keys.ADAPTER: "P", keys.FURA_S: "right"}


#: the largest model file whose external data files are looked for (one with external data keeps its weights out
#: of the file, so it is small; a larger one is not parsed a second time for this: its weights are in its sha256)
EXTERNAL_SCAN_BYTES = 64 << 20


#: pages (of SAMPLE_PAGE bytes) of each tensor's span an external data file's sampled digest reads
SAMPLE_PAGE, SAMPLE_PAGES = 4096, 32


def sampled_sha256(path: str, offsets: list[int]) -> str:
    """The sha256 of the file's size and of SAMPLE_PAGES pages of each span between consecutive `offsets` (the
    tensors' starts; the file's start and end bound the first and last span), spread evenly, first and last
    included; a span of at most SAMPLE_PAGES pages whole. Reads at most ~SAMPLE_PAGES pages per tensor."""
    size = os.path.getsize(path)
    bounds = sorted({0, size, *(offset for offset in offsets if 0 < offset < size)})
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        for start, end in zip(bounds, bounds[1:]):
            if end - start <= SAMPLE_PAGES * SAMPLE_PAGE:
                digest.update(os.pread(handle.fileno(), end - start, start))
                continue
            last = end - SAMPLE_PAGE
            for k in range(SAMPLE_PAGES):
                digest.update(os.pread(handle.fileno(), SAMPLE_PAGE, start + (last - start) * k // (SAMPLE_PAGES - 1)))
    return digest.hexdigest()


def data_record(path: str, offsets: list[int]) -> dict[str, Any]:
    """manifest `export.source.external_data`'s entry of one file (fblc.tools.export checks it)."""
    return {"bytes": os.path.getsize(path), "sampled_sha256": sampled_sha256(path, offsets)}


def source_record(model_path: str) -> dict[str, Any]:
    """manifest `export.source`: where the model was read, and the digests that say it is still that model (its
    file's sha256, and each external data file's data_record by its path relative to the model's folder)."""
    path = os.path.abspath(model_path)
    record: dict[str, Any] = {"path": path, "sha256": fmt.sha256_of(path), "bytes": os.path.getsize(path)}
    if record["bytes"] <= EXTERNAL_SCAN_BYTES:
        data = external_data_offsets(path)
        if data:
            record["external_data"] = {os.path.relpath(f, os.path.dirname(path)): data_record(f, offsets)
                                       for f, offsets in data.items()}
    return record


#: the adapter metadata whose frozen factor is drawn from --seed (MemFLoRA's P); FuRA-S's R comes from the weights
SEEDED = {keys.ADAPTER: True, keys.FURA_S: False}


def frozen_factors(step: ir.Model, key: str, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """The adapter's frozen factors by name: each site's factor that is a constant of the step, neither trained
    nor a forward bundle's specialist site (LoRA's A is trained, so LoRA has none)."""
    served = set(keys.json_of(step.graph.metadata_props, keys.SPECIALIST) or ())
    frozen = {}
    for site in meta["sites"]:
        value = step.graph.initializers.get(site[ADAPTER_METADATA[key]])
        if (value is not None and keys.get_role(value) != Role.PARAM.value and value.const_value is not None
                and value.name not in served):
            frozen[value.name] = value.const_value.numpy()
    return frozen


def adapter_fingerprint(source: dict[str, Any], step: ir.Model) -> dict[str, Any] | None:
    """manifest `fingerprint` of a step with an adapter (the module's docstring says what it holds), None without
    one. `id`, a sha256 of the compared fields, is what the native runner compares."""
    key = next((k for k in ADAPTER_METADATA if k in step.metadata_props), None)
    if key is None:
        return None
    meta = keys.json_of(step.metadata_props, key)
    base = hashlib.sha256(source["sha256"].encode())
    for recorded in sorted(r["sampled_sha256"] for r in source.get("external_data", {}).values()):
        base.update(recorded.encode())
    compared: dict[str, Any] = {"adapter": meta["adapter"], "base_sha256": base.hexdigest()}
    frozen = frozen_factors(step, key, meta)
    if frozen:
        digest = hashlib.sha256()
        for name in sorted(frozen):
            values = np.ascontiguousarray(frozen[name], np.float16)
            digest.update(f"{name}:{list(values.shape)}|".encode() + values.tobytes())
        compared["frozen_sha256"] = digest.hexdigest()
        if SEEDED[key]:
            compared["seed"] = meta.get("seed")
    identity = hashlib.sha256(json.dumps(compared, sort_keys=True).encode()).hexdigest()
    return {"id": identity, **compared, "model": source["path"]}


def export_record(model_path: str, step: ir.Model) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(manifest `export`, the extra bundle files: factors.npz where the adapter has frozen factors)."""
    record: dict[str, Any] = {"source": source_record(model_path), "adapter": None}
    for key, factor in ADAPTER_METADATA.items():
        if key not in step.metadata_props:
            continue
        meta = keys.json_of(step.metadata_props, key)
        record["adapter"] = meta
        frozen = {}
        for site in meta["sites"]:
            value = step.graph.initializers.get(site[factor])
            if value is not None and keys.get_role(value) != Role.PARAM.value and value.const_value is not None:
                frozen[site[factor]] = value.const_value.numpy()
        if frozen:
            buffer = io.BytesIO()
            np.savez(buffer, **frozen)
            record["factors"] = fmt.FACTORS
            return record, {fmt.FACTORS: buffer.getvalue()}
    return record, {}
