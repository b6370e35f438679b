"""Target profiles, the cache-geometry profiler and the texture-cache model (issue 5; not built yet)."""
