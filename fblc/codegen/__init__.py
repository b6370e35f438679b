"""OpenCL codegen and the bundle writer (issue 3; not built yet)."""
