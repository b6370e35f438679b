"""Target profiles (device facts), the profiler's microbenchmarks and the texture-cache model.

Only the limits that codegen needs exist yet: image size, wave size, work-group limit, fp16.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from fblc.compiler.errors import FblcError

TARGETS_DIR = os.path.join(os.path.dirname(__file__), "targets")
REQUIRED = ("name", "image2d_max_width", "image2d_max_height", "wave_size", "max_work_group_size")


@dataclass(frozen=True)
class Profile:
    name: str
    image2d_max_width: int
    image2d_max_height: int
    wave_size: int
    max_work_group_size: int
    fp16: bool
    raw: dict

    @property
    def digest(self) -> str:
        import hashlib

        return hashlib.sha256(json.dumps(self.raw, sort_keys=True).encode()).hexdigest()[:16]


def shipped_targets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(TARGETS_DIR) if f.endswith(".json"))


def load_profile(target: str) -> Profile:
    """A shipped target by name, or a profile JSON file by path."""
    path = target if target.endswith(".json") else os.path.join(TARGETS_DIR, f"{target}.json")
    if not os.path.isfile(path):
        raise FblcError(f"unknown target '{target}'",
                        f"choose one of: {', '.join(shipped_targets())}, or give a profile .json file")
    try:
        with open(path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except ValueError as error:
        raise FblcError(f"profile '{path}' is not valid JSON ({error})", "fix or regenerate the file") from None
    missing = [k for k in REQUIRED if not isinstance(raw.get(k), (int, str)) or raw.get(k) in ("", 0)]
    if missing:
        raise FblcError(f"profile '{path}' lacks {', '.join(missing)}", "add the missing figures")
    return Profile(raw["name"], int(raw["image2d_max_width"]), int(raw["image2d_max_height"]), int(raw["wave_size"]),
                   int(raw["max_work_group_size"]), bool(raw.get("fp16", False)), raw)
