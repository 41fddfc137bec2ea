"""Depthwise causal short convolution: ``naive`` reference (one gather + one einsum) and ``fla``
(flash-linear-attention's Triton kernel, context passed as its initial state; GPU)."""
