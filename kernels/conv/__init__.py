"""Depthwise causal short convolution: ``naive`` reference (one gather + one einsum)."""
