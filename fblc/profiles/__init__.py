"""Target profiles (device facts with their provenance), the profiler's microbenchmarks, the texture-cache model."""

from fblc.profiles.profile import FIGURES, Profile, load_profile, parse_profile, shipped_targets

__all__ = ["FIGURES", "Profile", "load_profile", "parse_profile", "shipped_targets"]
