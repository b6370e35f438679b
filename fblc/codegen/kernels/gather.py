"""gather kernels (being written)."""
