"""Editing a compiled bundle in tests: change plan.json and keep manifest.json's checksum true,
so that what the runtimes then refuse is the edit, not a checksum."""

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
    _checksum(bundle, fmt.PLAN)


def edit_kernels(bundle: str, source: str) -> None:
    """Replace the bundle's kernels.cl with `source` and re-checksum it in manifest.json."""
    with open(os.path.join(bundle, fmt.KERNELS), "w", encoding="utf-8") as handle:
        handle.write(source)
    _checksum(bundle, fmt.KERNELS)


def _checksum(bundle: str, name: str) -> None:
    path = os.path.join(bundle, name)
    manifest_path = os.path.join(bundle, fmt.MANIFEST)
    with open(manifest_path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    manifest["checksums"][name] = fmt.sha256_of(path)
    with open(manifest_path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)
