"""Mixture-of-experts FFN on compact rows, and multiplicity-weighted router statistics.

Routing (deterministic top-k, no token drop; one decision per compact row):

* ``moe_router="softmax"`` (Qwen3-Next): ``p = softmax(x W_r^T)``; pick the top-k of p; weights
  = the picked p, renormalised to sum 1 if ``norm_topk_prob``, times ``routed_scaling_factor``.
* ``moe_router="sigmoid"`` (Kimi Linear / DeepSeek-V3): ``s = sigmoid(x W_r^T)``; selection uses
  ``s + e_score_correction_bias`` (the bias never enters the weights); with ``n_group > 1`` only
  experts of the ``topk_group`` groups with the largest top-2 sums compete; weights = the picked
  s, renormalised (+1e-20) if ``norm_topk_prob``, times ``routed_scaling_factor``.

Router replay (``routed`` [C, k] expert ids, e.g. what the inference engine chose): the given
experts replace the row's own selection (bias and groups play no part in choosing), and their
weights are still the router's: the picked p (softmax) or s (sigmoid) gathered at the given
experts, renormalised and scaled exactly as above, as Megatron's router replay does. Statistics
count the replayed assignments.

Output ``y = sum_{e in topk} w_e * E_e(x) [+ sigmoid(x W_g) *] S(x)`` with SwiGLU experts E_e
stored as HF 3-D tensors (``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]) and an optional
shared expert S, gated by ``shared_expert_gate`` in Qwen3-Next and ungated in Kimi Linear.

Statistics (paper Section 3.5): a compact row c stands for q_c semantic positions, so every
per-token router quantity is weighted by q_c = ``view.row_weight``. Per MoE layer::

    z_loss_sum      = sum_c q_c * logsumexp(logits_c)^2
    prob_mass[e]    = sum_c q_c * p_c[e]          (p: softmax probs, or s / sum(s) for sigmoid)
    assign_count[e] = sum_c q_c * [e in topk(c)]
    tokens          = sum_c q_c

:class:`MoEStats` stacks these over MoE layers; :func:`z_loss`, :func:`load_balancing_loss` and
:func:`expert_load` are functions of the sums only, so summing microbatches with
:meth:`MoEStats.merge` gives batch-level values that do not depend on microbatching.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from harts.errors import ModelInputError
from harts.kernels import dispatch as kernel_dispatch
from harts.numerics import outside
from harts.runtime.config import HybridConfig
from harts.runtime.layers import MLP, compute_dtype

__all__ = [
    "Experts",
    "MoEStats",
    "SparseMoeBlock",
    "TopKRouter",
    "apply_expert_bias_update",
    "expert_load",
    "load_balancing_loss",
    "router_statistics",
    "z_loss",
]


@attrs.frozen
class MoEStats:
    """Router statistics summed over rows (weighted by q), one entry per MoE layer.

    Attributes:
        z_loss_sum: [L] sum_c q_c * logsumexp(logits_c)^2 (differentiable).
        prob_mass: [L, E] sum_c q_c * p_c (differentiable).
        assign_count: [L, E] sum_c q_c * 1[e in topk(c)] (no gradient).
        tokens: [L] sum_c q_c.
        routed_rows: rows routed by each MoE layer (every MoE layer routes each row once),
            summed over merged microbatches; 0 for a model without MoE layers.
    """

    z_loss_sum: torch.Tensor
    prob_mass: torch.Tensor
    assign_count: torch.Tensor
    tokens: torch.Tensor
    routed_rows: int = 0

    @property
    def num_layers(self) -> int:
        return int(self.z_loss_sum.shape[0])

    @classmethod
    def empty(cls, num_experts: int, *, device=None, dtype=torch.float32) -> MoEStats:
        """Statistics of a model without MoE layers (L = 0)."""
        return cls(
            z_loss_sum=torch.zeros(0, device=device, dtype=dtype),
            prob_mass=torch.zeros(0, num_experts, device=device, dtype=dtype),
            assign_count=torch.zeros(0, num_experts, device=device, dtype=dtype),
            tokens=torch.zeros(0, device=device, dtype=dtype),
        )

    @classmethod
    def stack(cls, per_layer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
              routed_rows: int, num_experts: int, *, device=None, dtype=torch.float32) -> MoEStats:
        """Build from per-layer (z_loss_sum, prob_mass, assign_count, tokens) tuples."""
        if not per_layer:
            return cls.empty(num_experts, device=device, dtype=dtype)
        z, mass, count, tokens = zip(*per_layer)
        return cls(torch.stack(z), torch.stack(mass), torch.stack(count), torch.stack(tokens), routed_rows)

    @staticmethod
    def merge(a: MoEStats, b: MoEStats) -> MoEStats:
        """Sum the statistics of two microbatches of the same model."""
        if a.prob_mass.shape != b.prob_mass.shape:
            raise ModelInputError(
                f"MoEStats.merge: shapes differ ({tuple(a.prob_mass.shape)} vs {tuple(b.prob_mass.shape)}); "
                "both must come from the same model"
            )
        return MoEStats(
            z_loss_sum=a.z_loss_sum + b.z_loss_sum,
            prob_mass=a.prob_mass + b.prob_mass,
            assign_count=a.assign_count + b.assign_count,
            tokens=a.tokens + b.tokens,
            routed_rows=a.routed_rows + b.routed_rows,
        )


def z_loss(stats: MoEStats) -> torch.Tensor:
    """Router z-loss: mean over MoE layers of (sum_c q_c * logsumexp(logits_c)^2) / (sum_c q_c)."""
    if stats.num_layers == 0:
        return stats.z_loss_sum.new_zeros(())
    return (stats.z_loss_sum / stats.tokens.clamp_min(1e-12)).mean()


def load_balancing_loss(stats: MoEStats) -> torch.Tensor:
    """Switch-style auxiliary loss as in HF ``load_balancing_loss_func``, averaged over MoE layers.

    Per layer: ``E * sum_e f_e * P_e`` with ``f_e = assign_count_e / tokens`` (fraction of
    tokens sent to e; sums to k) and ``P_e = prob_mass_e / tokens`` (mean router probability).
    """
    if stats.num_layers == 0:
        return stats.prob_mass.new_zeros(())
    tokens = stats.tokens.clamp_min(1e-12)[:, None]
    fraction = stats.assign_count / tokens
    mean_prob = stats.prob_mass / tokens
    num_experts = stats.prob_mass.shape[1]
    return (num_experts * (fraction * mean_prob).sum(dim=1)).mean()


def expert_load(stats: MoEStats) -> torch.Tensor:
    """[L, E] multiplicity-weighted assignment counts: the input of expert-bias updates."""
    return stats.assign_count.detach()


@torch.no_grad()
def apply_expert_bias_update(model: nn.Module, stats: MoEStats, *, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing step: ``bias_e += rate * sign(mean_load - load_e)`` per MoE layer.

    ``load`` is :func:`expert_load` (multiplicity-weighted), so a compact batch moves the biases
    exactly as its expanded trajectory-wise batch would. Routers without an expert bias are
    skipped. Returns the applied [L, E] update.
    """
    # harts.parallel's megatron-core MoE layer marks itself a MoE block (its router is its ``gate``)
    routers = [module.gate for module in model.modules()
               if isinstance(module, SparseMoeBlock) or getattr(module, "is_harts_moe_block", False)]
    if len(routers) != stats.num_layers:
        raise ModelInputError(f"stats hold {stats.num_layers} MoE layer(s) but the model has {len(routers)}")
    load = expert_load(stats)
    update = rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
    for router, layer_update in zip(routers, update):
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.add_(layer_update.to(router.e_score_correction_bias))
    return update


def configure_routing(router: nn.Module, config: HybridConfig) -> None:
    """Set on ``router`` what :meth:`TopKRouter.forward` and its helpers read: the routing options and the
    ``e_score_correction_bias`` [E] buffer (None without expert bias). harts.parallel's megatron router
    borrows those methods, so both routers are configured here."""
    router.kind = config.moe_router
    router.top_k = config.num_experts_per_tok
    router.num_experts = config.num_experts
    router.norm_topk_prob = config.norm_topk_prob
    router.routed_scaling_factor = config.routed_scaling_factor
    router.n_group = config.n_group
    router.topk_group = config.topk_group
    if config.moe_expert_bias:
        router.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
    else:
        router.e_score_correction_bias = None


class TopKRouter(nn.Module):
    """Router ``gate``: ``weight`` [E, D]; ``e_score_correction_bias`` [E] buffer when expert bias is on."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        configure_routing(self, config)
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))

    def forward(
        self, x: torch.Tensor, routed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [C, D], routed [C, k] replayed expert ids or None -> logits [C, E], probs [C, E] (for statistics), weights [C, k], indices [C, k]."""
        cd = compute_dtype(x.dtype)
        logits = F.linear(x.to(cd), self.weight.to(cd))
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1)
            scores = probs
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if routed is None:
            indices = self._select(scores.detach(), cd)
        else:
            self._check_routed(routed, x.shape[0])
            indices = routed.to(device=logits.device, dtype=torch.long)
        top_values = scores.gather(1, indices)
        if self.norm_topk_prob:
            total = top_values.sum(dim=-1, keepdim=True)
            top_values = top_values / (total if self.kind == "softmax" else total + 1e-20)
        weights = top_values * self.routed_scaling_factor
        return logits, probs, weights, indices

    def _select(self, scores: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
        """The row's own top-k experts [C, k] (softmax: by p; sigmoid: by s + bias, within the chosen groups)."""
        if self.kind == "softmax":
            return torch.topk(scores, self.top_k, dim=-1).indices
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.to(cd)
        if self.n_group > 1:
            grouped = choice.view(choice.shape[0], self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [C, n_group]
            chosen_groups = torch.topk(group_scores, self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape[0], self.num_experts)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        return torch.topk(choice, self.top_k, dim=-1).indices

    def _check_routed(self, routed: torch.Tensor, rows: int) -> None:
        if routed.shape != (rows, self.top_k) or routed.dtype.is_floating_point:
            raise ModelInputError(
                f"routed experts must be integer ids of shape [{rows}, {self.top_k}] (rows, top_k); "
                f"got {routed.dtype} of shape {tuple(routed.shape)}"
            )
        if routed.numel() and outside(routed, 0, self.num_experts):
            raise ModelInputError(f"routed expert ids must lie in [0, {self.num_experts}); got [{int(routed.min())}, {int(routed.max())}]")


class Experts(nn.Module):
    """SwiGLU experts as 3-D tensors: ``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.intermediate_size = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, self.intermediate_size))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [C, D], indices/weights [C, k] -> sum_j weights[:, j] * E_{indices[:, j]}(x).

        Through the kernel dispatch: grouped GEMMs on CUDA, the per-expert reference elsewhere.
        """
        return kernel_dispatch.moe_experts(x, indices, weights, self.gate_up_proj, self.down_proj)


class SparseMoeBlock(nn.Module):
    """Routed experts plus an optional (optionally gated) shared expert; returns output and statistics."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
        else:
            self.shared_expert = None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None

    def forward(
        self, x: torch.Tensor, row_weight: torch.Tensor, routed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """x [C, D], row_weight [C], routed [C, k] or None -> (y [C, D], (z_loss_sum, prob_mass [E], assign_count [E], tokens))."""
        logits, probs, weights, indices = self.gate(x, routed)
        y = self.experts(x, indices, weights.to(x.dtype))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared

        return y, router_statistics(logits, probs, indices, row_weight)


def router_statistics(
    logits: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, row_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MoE layer's q-weighted sums over rows (module docstring): (z_loss_sum, prob_mass [E], assign_count [E], tokens).

    ``logits`` / ``probs`` [C, E] and ``indices`` [C, k] are the router's (:meth:`TopKRouter.forward`);
    a row of weight 0 (a padding row) counts in none of the sums.
    """
    q = row_weight.to(device=logits.device, dtype=logits.dtype)
    z_sum = (q * torch.logsumexp(logits, dim=-1).pow(2)).sum()
    mass = (q[:, None] * probs).sum(dim=0)
    with torch.no_grad():
        top_k = indices.shape[1]
        count = torch.zeros(probs.shape[1], dtype=q.dtype, device=q.device).index_add(
            0, indices.reshape(-1), q.repeat_interleave(top_k)
        )
    return z_sum, mass, count, q.sum().detach()
