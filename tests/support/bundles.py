"""Editing a compiled bundle in tests: change plan.json, kernels.cl or manifest.json and keep the manifest's
checksums (its own included) true, so that what the runtimes then refuse is the edit, not a checksum."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from fblc import bundle_format as fmt


def edit_plan(bundle: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the bundle's plan.json in place and re-checksum it in manifest.json."""
    path = os.path.join(bundle, fmt.PLAN)
    with open(path, encoding="utf-8") as handle:
        plan = json.load(handle)
    edit(plan)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(plan, handle)
    rechecksum(bundle, fmt.PLAN)


def edit_kernels(bundle: str, source: str) -> None:
    """Replace the bundle's kernels.cl with `source` and re-checksum it in manifest.json."""
    with open(os.path.join(bundle, fmt.KERNELS), "w", encoding="utf-8") as handle:
        handle.write(source)
    rechecksum(bundle, fmt.KERNELS)


def edit_manifest(bundle: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to the bundle's manifest.json in place and seal it again (its manifest_sha256)."""
    manifest_path = os.path.join(bundle, fmt.MANIFEST)
    with open(manifest_path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    edit(manifest)
    with open(manifest_path, "wb") as handle:
        handle.write(fmt.sealed_manifest(manifest))


def rechecksum(bundle: str, name: str) -> None:
    """Record the checksum of the bundle's file `name`, as it is now, in manifest.json."""
    edit_manifest(bundle, lambda manifest: manifest["checksums"].update({name: fmt.sha256_of(os.path.join(bundle,
                                                                                                          name))}))



def compiled(folder: str, proto: Any, name: str, *flags: str) -> str:
    """Save `proto` as FOLDER/NAME.onnx and compile it (quietly) into the bundle FOLDER/NAME; its path."""
    import onnx

    from fblc.cli import main

    model = os.path.join(folder, f"{name}.onnx")
    onnx.save(proto, model)
    out = os.path.join(folder, name)
    assert main(["compile", model, "-o", out, "-q", *flags]) == 0
    return out
