"""Maintenance tools that read every registry (python -m fblc.tools.op_audit)."""
