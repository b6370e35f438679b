"""contraction kernels (being written)."""
