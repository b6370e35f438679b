"""Gradient rules, grouped by meaning; importing this package registers them all."""

from fblc.compiler.gradients import activations, elementwise, linalg, pooling, reduce, resample, scan, tensor  # noqa: F401
