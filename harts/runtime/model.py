"""The hybrid-attention language model that HARTS trains: :class:`HybridModel`.

Rows in, rows out: the model sees C hidden rows (compact rows of a plan, or the packed
positions of independent trajectories) and an :class:`~harts.runtime.view.ExecutionView`
that tells the sequence operators how rows relate. Per block (pre-norm)::

    x = x + mixer(input_layernorm(x), view)        # KDA / GDN / MHA / GQA / MLA (KDA / GDN on the
                                                   # view's linear-attention rows, harts.runtime.view.linear_rows)
    x = x + mlp(post_attention_layernorm(x))       # dense SwiGLU or MoE (weighted by view.row_weight)

then ``hidden = norm(x)`` and ``logits = lm_head(hidden)``. ``routed_experts`` [C, L_moe, k]
(router replay) gives every MoE layer the experts of each row, layer ``i`` of it for the
``i``-th MoE layer of the model. ``recompute=True`` wraps each block
in non-reentrant activation checkpointing, so backward re-executes the block from the same
view. Module names follow the HF models (``embed_tokens``, ``layers.i.{linear_attn|self_attn}``,
``layers.i.mlp``, ``layers.i.input_layernorm``, ``norm``, ``lm_head``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts.errors import ModelInputError
from harts.kernels.linear_attention.chunk import keep_backward_intermediates
from harts.numerics import outside
from harts.runtime.config import HybridConfig
from harts.runtime.layers import (
    MLP,
    FullAttention,
    GatedDeltaNet,
    GatedRMSNorm,
    KimiDeltaAttention,
    KimiForgetGate,
    MultiLatentAttention,
    RMSNorm,
    ShortConvolution,
    compute_dtype,
)
from harts.runtime.moe import Experts, MoEStats, SparseMoeBlock, TopKRouter
from harts.runtime.view import ExecutionView, linear_rows

__all__ = ["DecoderLayer", "HybridModel"]


class DecoderLayer(nn.Module):
    """One pre-norm block: token mixer (``linear_attn`` or ``self_attn``) and FFN (``mlp``)."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        #: Index of this block among the MoE blocks (router replay reads that layer), else None.
        self.moe_index = config.mlp_layer_types[:layer_idx].count("moe") if config.mlp_layer_types[layer_idx] == "moe" else None
        self.layer_type = config.layer_types[layer_idx]
        self.mlp_type = config.mlp_layer_types[layer_idx]
        if self.layer_type == "linear":
            self.linear_attn = KimiDeltaAttention(config) if config.linear == "kda" else GatedDeltaNet(config)
        elif config.attention == "mla":
            self.self_attn = MultiLatentAttention(config)
        else:
            self.self_attn = FullAttention(config)
        if self.mlp_type == "moe":
            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_zero_centered)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_zero_centered)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == "linear" else self.self_attn

    def _mix(self, h: torch.Tensor, view: ExecutionView) -> torch.Tensor:
        """The token mixer on normed rows; a linear-attention mixer runs on the view's linear-attention rows."""
        if self.layer_type != "linear":
            return self.mixer(h, view)
        rows = linear_rows(view)
        return rows.unpack(self.mixer(rows.pack(h), rows.view))

    def forward(self, x: torch.Tensor, view: ExecutionView, routed_experts: torch.Tensor | None = None):
        """x [C, D], routed_experts [C, L_moe, k] or None -> (x [C, D], MoE statistics tuple or None)."""
        x = x + self._mix(self.input_layernorm(x), view)
        normed = self.post_attention_layernorm(x)
        if self.mlp_type == "moe":
            routed = None if routed_experts is None else routed_experts[:, self.moe_index]
            update, stats = self.mlp(normed, view.row_weight, routed)
        else:
            update, stats = self.mlp(normed), None
        return x + update, stats


def _checkpointed_block(layer, x: torch.Tensor, view, routed_experts):
    # the checkpoint calls this in the block's first forward and again in its recompute, so the
    # linear-attention calls keep their backward intermediates in both, which the checkpoint drops from
    # the first and holds from the second for this block's backward only
    with keep_backward_intermediates():
        return layer(x, view, routed_experts)


def run_blocks(layers, x: torch.Tensor, view, routed_experts, recompute: bool) -> tuple[torch.Tensor, list[MoEStats]]:
    """Run the decoder blocks in order on ``x``, each under activation checkpointing when ``recompute``
    and gradients are on; returns the output and the MoE blocks' statistics, in layer order."""
    per_layer = []
    for layer in layers:
        if recompute and torch.is_grad_enabled():
            x, stats = checkpoint(_checkpointed_block, layer, x, view, routed_experts, use_reentrant=False)
        else:
            x, stats = layer(x, view, routed_experts)
        if stats is not None:
            per_layer.append(stats)
    return x, per_layer


class HybridModel(nn.Module):
    """Decoder-only hybrid-attention LM built from a :class:`HybridConfig`."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_zero_centered)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.to(config.torch_dtype)
        # As the HF models do, router weights, expert biases and decay biases stay in at least float32.
        keep = compute_dtype(config.torch_dtype)
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.weight.data = module.weight.data.to(keep)
                if module.e_score_correction_bias is not None:
                    module.e_score_correction_bias = module.e_score_correction_bias.to(keep)
            elif isinstance(module, KimiForgetGate):
                module.dt_bias.data = module.dt_bias.data.to(keep)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF-style initialisation: normal(0, initializer_range) for projections, embeddings, experts and routers."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, (RMSNorm, GatedRMSNorm, ShortConvolution)):
                module.reset_parameters()
            elif isinstance(module, (GatedDeltaNet, KimiForgetGate)):
                module.reset_special_parameters()
            elif isinstance(module, Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, TopKRouter):
                module.weight.normal_(0.0, std)
                if module.e_score_correction_bias is not None:
                    module.e_score_correction_bias.zero_()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [C] -> [C, D]."""
        return self.embed_tokens(input_ids)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        view: ExecutionView,
        *,
        recompute: bool = False,
        routed_experts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MoEStats]:
        """input_ids [C], routed_experts [C, L_moe, k] or None -> (hidden [C, D] after the final norm, MoE statistics weighted by view.row_weight)."""
        if input_ids.dim() != 1:
            raise ModelInputError(f"input_ids must be 1-D [C], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] != view.num_rows:
            raise ModelInputError(f"input_ids has {input_ids.shape[0]} rows but the view has {view.num_rows}")
        # ids the runtime put on the device carry their host copy: checked there, without a device read
        if input_ids.numel() and outside(input_ids, 0, self.config.vocab_size):
            raise ModelInputError(
                f"input_ids must lie in [0, {self.config.vocab_size}); got range "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )
        if routed_experts is not None:
            expected = (input_ids.shape[0], self.config.num_moe_layers, self.config.num_experts_per_tok)
            if tuple(routed_experts.shape) != expected:
                raise ModelInputError(
                    f"routed_experts must have shape [rows, MoE layers, top_k] = {list(expected)}, got {list(routed_experts.shape)}"
                )
        x, per_layer = run_blocks(self.layers, self.embed(input_ids), view, routed_experts, recompute)
        routed_rows = view.num_rows if per_layer else 0
        aux = MoEStats.stack(
            per_layer, routed_rows, self.config.num_experts, device=x.device, dtype=compute_dtype(x.dtype)
        )
        return self.norm(x), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [C, D] -> logits [C, V]."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        view: ExecutionView,
        *,
        recompute: bool = False,
        routed_experts: torch.Tensor | None = None,
        head: Callable[[HybridModel, torch.Tensor], Any] | None = None,
    ):
        """input_ids [C] -> (logits [C, V], MoE statistics); ``routed_experts`` as in :meth:`forward_hidden`.

        ``head(model, hidden)``, when given, replaces the LM head: the call returns
        ``(head(self, hidden), moe_fields)`` with ``moe_fields`` the :class:`MoEStats` fields
        as a plain tuple (``MoEStats(*moe_fields)`` rebuilds it). The runtime passes its
        log-prob program here, so that everything that reads parameters runs inside this
        call, hence inside a data-parallel wrapper's forward: DDP prepares its gradient
        all-reduce there and FSDP2 all-gathers the sharded parameters there (calling
        ``forward_hidden`` on ``ddp.module`` would skip both). Plain tuples, because the
        wrappers look for output tensors in tuples, lists and dicts only.
        """
        hidden, aux = self.forward_hidden(input_ids, view, recompute=recompute, routed_experts=routed_experts)
        if head is None:
            return self.logits(hidden), aux
        return head(self, hidden), attrs.astuple(aux, recurse=False)
