"""What `fblc export` needs from a bundle, recorded when it is compiled (manifest.json `export`, factors.npz).

The bundle's own tensors are texture contents in device layouts, and its step is fused kernels: neither gives
back the model's graph. So the bundle records which model it was compiled from (its absolute path, the sha256
and size of the .onnx file: the export reads the graph and the frozen weights there and refuses a file that
changed) and what the adapter made of it: the sites (the pass metadata, fblc.adapter or fblc.fura_s) and the
frozen factors the merge needs, which the compiler drew or computed and the trained parameters lack
(MemFLoRA's P, FuRA-S's block right singular vectors R): factors.npz, checksummed like the other files.
A copy of the model is not kept: it would double a bundle of a large model.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import onnx_ir as ir

from fblc import bundle_format as fmt
from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.model_io import external_data_files

#: the pass metadata that describes each kind of adapter sites, and the frozen factor each site names
ADAPTER_METADATA = {keys.ADAPTER: "P", keys.FURA_S: "right"}


#: the largest model file whose external data files are looked for (one with external data keeps its weights out
#: of the file, so it is small; a larger one is not parsed a second time for this: its weights are in its sha256)
EXTERNAL_SCAN_BYTES = 64 << 20


def source_record(model_path: str) -> dict[str, Any]:
    """manifest `export.source`: where the model was read, and the digests that say it is still that model (its
    file's, and each external data file's by its path relative to the model's folder)."""
    path = os.path.abspath(model_path)
    record: dict[str, Any] = {"path": path, "sha256": fmt.sha256_of(path), "bytes": os.path.getsize(path)}
    if record["bytes"] <= EXTERNAL_SCAN_BYTES:
        data = external_data_files(path)
        if data:
            record["external_data"] = {os.path.relpath(f, os.path.dirname(path)): fmt.sha256_of(f) for f in data}
    return record


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
