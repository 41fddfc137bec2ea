"""The pure-torch reference of every operator, as one kernels namespace.

Pass this module as ``kernels=`` to an execution view (or use ``Dispatch(mode="naive")``) to
run everything on the references: CPU, float64-capable, differentiable through autograd.
Every fast path is held to these in the tests, forward and backward.
"""

from .attention.naive import attention, attention_backward, attention_forward
from .conv.naive import causal_conv1d
from .linear_attention.naive import chunk_linear_attention, recurrent_linear_attention
from .moe.naive import moe_experts

__all__ = ["attention", "attention_backward", "attention_forward", "causal_conv1d", "chunk_linear_attention", "moe_experts", "recurrent_linear_attention"]
