"""Moved to fblc.codegen.reports: remove with compile.py's import of it."""
from fblc.codegen.reports import estimate_object  # noqa: F401
