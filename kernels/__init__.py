"""Sequence kernels of the HARTS runtime (importable as ``harts.kernels``).

``harts.kernels.naive`` holds the pure-torch reference implementations that run on CPU in
float32/float64 and are differentiable through autograd. Every fast GPU path is held to
them, forward and backward:

* ``chunk_linear_attention``: packed varlen chunkwise gated delta rule (KDA per-key-channel
  decay, Gated DeltaNet per-head decay) with initial states and exported chunk-boundary
  states;
* ``recurrent_linear_attention``: the same recurrence evaluated token by token (test oracle);
* ``causal_conv1d``: packed varlen depthwise causal convolution with per-sequence context;
* ``attention``: packed varlen softmax attention with separate query and key spans and
  bottom-right causal alignment (GQA by repeating key/value heads).
"""

from .naive import (
    attention,
    causal_conv1d,
    chunk_linear_attention,
    recurrent_linear_attention,
)

__all__ = [
    "attention",
    "causal_conv1d",
    "chunk_linear_attention",
    "recurrent_linear_attention",
]
