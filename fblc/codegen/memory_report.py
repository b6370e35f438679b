"""Moved to fblc.codegen.reports: remove with compile.py's import of it."""
from fblc.codegen.reports import TIMELINE_PLOT, memory_report  # noqa: F401
