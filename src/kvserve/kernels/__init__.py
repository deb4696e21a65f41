"""Compiled kernels for what PyTorch has no op for (paged attention on CPU)."""
