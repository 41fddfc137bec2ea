"""Pure-torch reference of routed SwiGLU experts: one matmul pair per expert that was hit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["moe_experts"]


def moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """``out[c] = sum_j weights[c, j] * down_e(silu(gate_e(x_c)) * up_e(x_c))``, ``e = indices[c, j]``.

    Args:
        x: [C, D]; indices, weights: [C, k]; gate_up_proj: [E, 2I, D] (HF layout); down_proj: [E, D, I].
    Returns:
        [C, D] in x's dtype.
    """
    out = torch.zeros_like(x)
    with torch.no_grad():
        hit = torch.unique(indices).tolist()
    for expert in hit:
        rows, slot = torch.where(indices == expert)
        gate, up = F.linear(x[rows], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert])
        out = out.index_add(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
    return out
