"""Runtimes that execute a bundle: local pyopencl and the native runner (issues 3 and 7; not built yet)."""
