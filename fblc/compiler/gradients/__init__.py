"""Gradient rules, grouped by meaning; importing this package registers them all."""

from fblc.compiler.gradients import elementwise, linalg, pooling, reduce, tensor  # noqa: F401
