"""Hand-written kernels for inference paths (optional: they need the `triton` package and, for speed, CUDA)."""
