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
    manifest_path = os.path.join(bundle, fmt.MANIFEST)
    with open(manifest_path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    manifest["checksums"][fmt.PLAN] = fmt.sha256_of(path)
    with open(manifest_path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)
