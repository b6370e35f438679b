"""fblc: a training compiler for mobile GPUs (docs/ARCHITECTURE.md describes how it is built)."""

__version__ = "0.1.0"
