"""Runtime test helpers: tiny hybrid models and compiled plans for them."""

from __future__ import annotations

import functools

import numpy as np
import torch

from harts.codegen.layout import lay_out
from harts.ir.verify import verify
from harts.plan import Plan, compute_stats
from harts.runtime import HybridConfig, HybridModel
from harts.runtime.moe import TopKRouter
from tests.helpers.layout import rounded_module
from tests.helpers.strategies import forked_trajectories
import harts


def make_plan(batch, chunk_size, groups=None) -> Plan:
    """A laid-out plan whose microbatches are ``groups`` (see :func:`rounded_module`), as ``codegen`` lays it out."""
    stage = lay_out(rounded_module(batch, chunk_size, groups))
    verify(stage)
    return Plan(module=stage.module, pipeline="prefix-compress,segment,min-call-rounds,codegen",
                stats=compute_stats(stage.module, laid_out=True), layouts=stage.layouts)


@functools.lru_cache(maxsize=None)
def tiny_model(linear="kda", attention="mla", ffn="moe", dtype="float64", seed=0, vocab_size=128) -> HybridModel:
    torch.manual_seed(seed)
    config = HybridConfig.preset(
        "tiny", linear=linear, attention=attention, ffn=ffn, dtype=dtype, vocab_size=vocab_size,
        layer_types=["linear", "full", "linear"], hidden_size=32, intermediate_size=48,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_attention_heads=2, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
    )
    model = HybridModel(config)
    if config.moe_expert_bias:
        # a non-zero selection bias, so that biased routing is exercised too
        for module in model.modules():
            if isinstance(module, TopKRouter) and module.e_score_correction_bias is not None:
                module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias) * 0.1)
    return model


#: A small MoE model for the CLI runs (the "tiny" preset, shrunk), as YAML overrides.
SMALL_MODEL = dict(
    hidden_size=32, num_layers=3, layer_types=["linear", "full", "linear"], intermediate_size=48,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, num_attention_heads=2, head_dim=8, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
)


def rl_batch(trajectories, seed=0, mask_from=2):
    """Trajectories with GRPO rewards in groups and a loss mask that leaves the first tokens out."""
    rng = np.random.default_rng(seed)
    return harts.RolloutBatch.from_trajectories(
        trajectories,
        reward=rng.random(len(trajectories)),
        group_id=[i % 3 for i in range(len(trajectories))],
        advantages=rng.normal(size=len(trajectories)),
        loss_mask=[(np.arange(len(t)) >= mask_from).astype(np.float32) for t in trajectories],
    )


def forked_batch(chunk=4):
    """Forks before, on and after chunk boundaries (B-1, B, B+1), nested forks and a prefix trajectory."""
    trajectories = forked_trajectories(chunk)
    trajectories += [t[: 2 * chunk + 1] + [7, 8, 9, 10, 11] for t in trajectories[:4]] + [trajectories[0][:chunk]]
    return rl_batch(trajectories)


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) / max(float(b[k].abs().max()), 1e-30) for k in a)
