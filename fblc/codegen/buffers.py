"""Moved to fblc.codegen.plan: remove with compile.py's and bundle.py's imports of it."""
from fblc.codegen.plan import BufferTable, buffer_table  # noqa: F401
