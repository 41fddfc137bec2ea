"""Token mixers and dense FFN of the hybrid model, on compact rows plus an execution view.

Every layer takes hidden rows ``x`` [C, D] and an :class:`~harts.runtime.view.ExecutionView`.
Token-wise work (projections, norms, gates, RoPE) runs once per row; the sequence operators
(short causal convolution, gated delta rule, softmax attention) go through the view, which
knows each row's trajectory history. Parameter names and layouts mirror the Hugging Face
implementations so checkpoints map one to one:

* :class:`GatedDeltaNet` = Qwen3-Next ``linear_attn``: ``in_proj_qkvz``/``in_proj_ba`` (grouped
  per key head), SiLU short conv over [q; k; v], ``beta = sigmoid(b)``, per-head decay
  ``g = -exp(A_log) * softplus(a + dt_bias)``, l2-normalised q/k (value heads share key heads),
  gated RMSNorm ``norm(o) * silu(z)``, ``out_proj``.
* :class:`KimiDeltaAttention` = Kimi Linear KDA: ``q_proj/k_proj/v_proj``, one SiLU short conv
  over [q; k; v], per-channel decay ``g = -exp(A_log_h) * softplus(f_b(f_a(x)) + dt_bias)``,
  ``beta = sigmoid(b_proj(x))``, l2-normalised q/k, gated RMSNorm ``norm(o) * sigmoid(g_b(g_a(x)))``,
  ``o_proj``.
* :class:`FullAttention` = Qwen3-Next ``self_attn`` (MHA/GQA): optional per-head output gate
  packed with q in ``q_proj``, optional q/k RMSNorm over the head dim, partial rotary
  embedding of the leading dims, ``o = o_proj(attn * sigmoid(gate))``.
* :class:`MultiLatentAttention` = Kimi Linear / DeepSeek MLA: q (``q_proj`` or low-rank
  ``q_a_proj -> q_a_layernorm -> q_b_proj``), ``kv_a_proj_with_mqa`` -> [latent; shared rope
  key], ``kv_a_layernorm``, ``kv_b_proj`` -> per-head [k_nope; v]. Kimi Linear applies no
  rotation (NoPE, ``use_rope=False``); with ``use_rope`` the rope parts of q and the shared key
  are rotated with each row's trajectory position.
* :class:`MLP`: SwiGLU ``down(silu(gate(x)) * up(x))``.

Norms, gates and the linear-attention core run in at least float32, as the reference
implementations do; results are cast back to the model dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harts.errors import ModelInputError
from harts.numerics import compute_dtype
from harts.runtime.config import HybridConfig
from harts.runtime.view import ExecutionView

__all__ = [
    "FullAttention",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "KimiDeltaAttention",
    "KimiForgetGate",
    "MLP",
    "MultiLatentAttention",
    "RMSNorm",
    "ShortConvolution",
    "apply_rotary",
    "compute_dtype",
    "rotary_cos_sin",
]


class RMSNorm(nn.Module):
    """``y = x / rms(x) * w`` (Kimi/Llama form) or ``y = x / rms(x) * (1 + w)`` (Qwen3-Next, zero-centred)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.to(compute_dtype(x.dtype))
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight.to(normed.dtype))).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


class GatedRMSNorm(nn.Module):
    """``y = x / rms(x) * w * act(gate)`` over the last dim, act = silu (GDN) or sigmoid (KDA)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ModelInputError(f"GatedRMSNorm activation must be 'silu' or 'sigmoid', got {activation!r}")
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        cd = compute_dtype(x.dtype)
        work = x.to(cd)
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(cd)
        gate = gate.to(cd)
        gated = normed * (F.silu(gate) if self.activation == "silu" else torch.sigmoid(gate))
        return gated.to(x.dtype)


class ShortConvolution(nn.Module):
    """Depthwise causal convolution over each row's trajectory history, weight laid out as ``nn.Conv1d`` [D, 1, W]."""

    def __init__(self, channels: int, width: int, bias: bool = False):
        super().__init__()
        self.channels = channels
        self.width = width
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.width)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, view: ExecutionView, activation: str | None = "silu") -> torch.Tensor:
        return view.causal_conv(x, self.weight[:, 0, :], self.bias, activation)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, width={self.width}, bias={self.bias is not None}"


# --------------------------------------------------------------------------- rotary embedding


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [C, rotary_dim] for the HF "default" RoPE: inv_freq_i = theta^(-2i/d), halves repeated."""
    cd = compute_dtype(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=cd, device=positions.device) / rotary_dim))
    freqs = positions.to(cd)[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [C, H, d] with cos/sin [C, d]; ``interleaved`` de-interleaves pairs first (DeepSeek layout)."""
    if interleaved:
        rows, heads, dim = x.shape
        x = x.view(rows, heads, dim // 2, 2).transpose(-1, -2).reshape(rows, heads, dim)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def _l2norm_rsqrt(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3-Next form: x * rsqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _l2norm_div(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Kimi Linear form: x / sqrt(sum x^2 + eps)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


# --------------------------------------------------------------------------- linear attention


def _linear_attention(view: ExecutionView, dtype: torch.dtype, q, k, v, log_decay, beta, *, scale: float) -> torch.Tensor:
    """The view's gated delta rule with q, k, v and beta in the model dtype and the log decay in
    at least float32, as fla's chunk kernels take them (bf16 operands, fp32 gates and accumulation)."""
    o = view.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), log_decay, beta.to(dtype), scale=scale)
    return o.to(dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Qwen3-Next layout); see the module docstring for the math."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = config.linear_conv_channels
        self.in_proj_qkvz = nn.Linear(self.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, 2 * self.num_v_heads, bias=False)
        self.conv1d = ShortConvolution(self.conv_dim, config.linear_conv_kernel_dim, bias=config.linear_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps, activation="silu")
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        self.reset_special_parameters()

    def reset_special_parameters(self) -> None:
        with torch.no_grad():
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16.0).log())

    def forward(self, x: torch.Tensor, view: ExecutionView) -> torch.Tensor:
        rows = x.shape[0]
        group = self.num_v_heads // self.num_k_heads
        # projections are grouped per key head: [q_h, k_h, v of its value heads, z of its value heads]
        qkvz = self.in_proj_qkvz(x).view(rows, self.num_k_heads, 2 * self.head_k_dim + 2 * group * self.head_v_dim)
        q, k, v, z = torch.split(
            qkvz, [self.head_k_dim, self.head_k_dim, group * self.head_v_dim, group * self.head_v_dim], dim=-1
        )
        b, a = torch.split(self.in_proj_ba(x).view(rows, self.num_k_heads, 2 * group), [group, group], dim=-1)
        z = z.reshape(rows, self.num_v_heads, self.head_v_dim)
        b = b.reshape(rows, self.num_v_heads)
        a = a.reshape(rows, self.num_v_heads)

        mixed = torch.cat(
            [q.reshape(rows, self.key_dim), k.reshape(rows, self.key_dim), v.reshape(rows, self.value_dim)], dim=-1
        )
        mixed = self.conv1d(mixed, view, activation="silu")
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)

        cd = compute_dtype(x.dtype)
        q = q.reshape(rows, self.num_k_heads, self.head_k_dim).to(cd)
        k = k.reshape(rows, self.num_k_heads, self.head_k_dim).to(cd)
        v = v.reshape(rows, self.num_v_heads, self.head_v_dim).to(cd)
        beta = torch.sigmoid(b).to(cd)
        log_decay = -self.A_log.to(cd).exp() * F.softplus(a.to(cd) + self.dt_bias.to(cd))  # [C, Hv]
        q, k = _l2norm_rsqrt(q), _l2norm_rsqrt(k)
        if group > 1:
            q = q.repeat_interleave(group, dim=1)
            k = k.repeat_interleave(group, dim=1)
        o = _linear_attention(view, x.dtype, q, k, v, log_decay, beta, scale=self.head_k_dim**-0.5)
        o = self.norm(o, z).reshape(rows, self.value_dim)
        return self.out_proj(o)


class KimiForgetGate(nn.Module):
    """Per-channel log decay ``-exp(A_log_h) * softplus(f_b(f_a(x)) + dt_bias)`` -> [C, H, K]."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.num_heads = config.linear_num_key_heads
        self.head_dim = config.linear_key_head_dim
        self.f_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.num_heads * self.head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads * self.head_dim))
        self.A_log = nn.Parameter(torch.empty(1, 1, self.num_heads, 1))  # HF layout
        self.reset_special_parameters()

    def reset_special_parameters(self) -> None:
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(_inverse_softplus(dt))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = compute_dtype(x.dtype)
        raw = self.f_b_proj(self.f_a_proj(x)).to(cd) + self.dt_bias.to(cd)
        raw = raw.view(x.shape[0], self.num_heads, self.head_dim)
        rate = self.A_log.to(cd).exp().view(self.num_heads, 1)
        return -rate * F.softplus(raw)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention token mixer (Kimi Linear layout); see the module docstring for the math."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_heads * self.head_k_dim
        self.value_dim = self.num_heads * self.head_v_dim
        self.q_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.conv1d = ShortConvolution(
            config.linear_conv_channels, config.linear_conv_kernel_dim, bias=config.linear_conv_bias
        )
        self.forget_gate = KimiForgetGate(config)
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(self.hidden_size, self.head_v_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_v_dim, self.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, view: ExecutionView) -> torch.Tensor:
        rows = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = self.conv1d(mixed, view, activation="silu")
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)

        cd = compute_dtype(x.dtype)
        q = _l2norm_div(q.reshape(rows, self.num_heads, self.head_k_dim).to(cd))
        k = _l2norm_div(k.reshape(rows, self.num_heads, self.head_k_dim).to(cd))
        v = v.reshape(rows, self.num_heads, self.head_v_dim).to(cd)
        log_decay = self.forget_gate(x)  # [C, H, K]
        beta = torch.sigmoid(self.b_proj(x)).to(cd)
        o = _linear_attention(view, x.dtype, q, k, v, log_decay, beta, scale=self.head_k_dim**-0.5)
        gate = self.g_b_proj(self.g_a_proj(x)).view(rows, self.num_heads, self.head_v_dim)
        o = self.o_norm(o, gate).reshape(rows, self.value_dim)
        return self.o_proj(o)


# --------------------------------------------------------------------------- full attention


class FullAttention(nn.Module):
    """MHA / GQA with optional output gate, q/k norm and partial RoPE (Qwen3-Next layout)."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attention_output_gate
        self.rotary_dim = config.rotary_dim if config.use_rope else 0
        self.rope_theta = config.rope_theta
        self.rope_interleave = config.rope_interleave
        self.scaling = self.head_dim**-0.5
        q_width = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_zero_centered)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_zero_centered)
        else:
            self.q_norm = self.k_norm = None

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = apply_rotary(x[..., : self.rotary_dim], cos, sin, self.rope_interleave)
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)

    def forward(self, x: torch.Tensor, view: ExecutionView) -> torch.Tensor:
        rows = x.shape[0]
        if self.output_gate:
            # per head: [query_h, gate_h] side by side in q_proj's output
            q, gate = torch.chunk(self.q_proj(x).view(rows, self.num_heads, 2 * self.head_dim), 2, dim=-1)
            gate = gate.reshape(rows, self.num_heads * self.head_dim)
        else:
            q, gate = self.q_proj(x).view(rows, self.num_heads, self.head_dim), None
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim:
            cos, sin = rotary_cos_sin(view.positions, self.rotary_dim, self.rope_theta, q.dtype)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        o = view.attention(q, k, v, scale=self.scaling).reshape(rows, self.num_heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


class MultiLatentAttention(nn.Module):
    """Multi-head latent attention (Kimi Linear / DeepSeek layout); RoPE on the rope part if ``use_rope``."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.use_rope = config.use_rope and self.qk_rope_head_dim > 0
        self.rope_theta = config.rope_theta
        self.rope_interleave = config.rope_interleave
        self.scaling = self.qk_head_dim**-0.5
        hidden = config.hidden_size
        latent_eps = config.rms_norm_eps if config.mla_latent_norm_eps is None else config.mla_latent_norm_eps
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, latent_eps, config.norm_zero_centered)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, latent_eps, config.norm_zero_centered)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, view: ExecutionView) -> torch.Tensor:
        rows = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(rows, self.num_heads, self.qk_head_dim)
        latent, k_rope = torch.split(
            self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(
            rows, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = k_rope.view(rows, 1, self.qk_rope_head_dim)
        if self.use_rope:
            cos, sin = rotary_cos_sin(view.positions, self.qk_rope_head_dim, self.rope_theta, q.dtype)
            q_nope, q_rope = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin, self.rope_interleave)], dim=-1)
            k_rope = apply_rotary(k_rope, cos, sin, self.rope_interleave)
        k = torch.cat([k_nope, k_rope.expand(rows, self.num_heads, self.qk_rope_head_dim)], dim=-1)
        o = view.attention(q, k, v, scale=self.scaling).reshape(rows, self.num_heads * self.v_head_dim)
        return self.o_proj(o)


# --------------------------------------------------------------------------- dense FFN


class MLP(nn.Module):
    """SwiGLU feed-forward ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
