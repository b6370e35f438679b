"""Gradient rules, grouped by meaning; importing this package registers them all."""

from fblc.compiler.gradients import (  # noqa: F401
    activations, elementwise, linalg, pooling, reduce, resample, scan, scatter, tensor)
