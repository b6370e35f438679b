"""normalize kernels (being written)."""
