"""pooling kernels (being written)."""
