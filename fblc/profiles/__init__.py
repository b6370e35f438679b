"""Target profiles (device facts with their provenance), the profiler's microbenchmarks, the texture-cache model."""

from fblc.profiles.profile import (FIGURES, PORTABLE_IMAGE_EDGE, Profile, load_profile, parse_profile,
                                   placement_limits, shipped_targets)

__all__ = ["FIGURES", "PORTABLE_IMAGE_EDGE", "Profile", "placement_limits", "load_profile", "parse_profile", "shipped_targets"]
