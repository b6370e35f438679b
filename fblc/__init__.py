"""fblc: a training compiler for mobile GPUs (see DESIGN.md)."""

__version__ = "0.1.0"
