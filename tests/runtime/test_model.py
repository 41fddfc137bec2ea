"""HybridModel on the trajectory-wise BaselineView: packing, recomputation, variants, MoE statistics, HF parity."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.runtime.config import HybridConfig, HybridConfigError
from harts.runtime.model import HybridModel
from harts.runtime.moe import (
    MoEStats,
    SparseMoeBlock,
    apply_expert_bias_update,
    expert_load,
    load_balancing_loss,
    z_loss,
)
from harts.runtime.view import BaselineView, ExecutionView

F64 = torch.float64
#: The linear-attention chunk of the baseline views here (the chunk size is the plan's, not the model's).
CHUNK = 16


pytestmark = pytest.mark.usefixtures("single_thread")
COMBINATIONS = list(itertools.product(["kda", "gdn"], ["mha", "gqa", "mla"], ["dense", "moe"]))


@functools.lru_cache(maxsize=None)
def _model(linear="kda", attention="mla", ffn="moe", dtype="float64", **overrides) -> HybridModel:
    torch.manual_seed(0)
    config = HybridConfig.preset("tiny", linear=linear, attention=attention, ffn=ffn, dtype=dtype, **overrides)
    model = HybridModel(config)
    _perturb_biases(model, seed=1)
    return model


def _perturb_biases(model, seed):
    """Non-zero expert biases, so selection-only bias is exercised."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype))


def _tokens(lengths, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (sum(lengths),), generator=generator)


def _assert_stats_close(got: MoEStats, want: MoEStats, **tolerance):
    assert got.routed_rows == want.routed_rows
    for field in ("z_loss_sum", "prob_mass", "assign_count", "tokens"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), **tolerance, msg=field)


def test_baseline_view_is_an_execution_view():
    view = BaselineView([3, 0, 5], chunk_size=4)
    assert isinstance(view, ExecutionView)
    assert view.num_rows == 8
    assert view.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert view.row_weight.tolist() == [1.0] * 8
    assert view.cu_seqlens.tolist() == [0, 3, 3, 8]


@settings(max_examples=20, deadline=None)
@given(
    combination=st.sampled_from(
        [("kda", "mla", "moe"), ("gdn", "gqa", "moe"), ("kda", "mha", "dense"), ("gdn", "mla", "moe")]
    ),
    lengths=st.lists(st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33]) | st.integers(1, 40), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_baseline_over_several_sequences_equals_each_sequence_alone(combination, lengths, seed):
    model = _model(*combination)
    ids = _tokens(lengths, model.config.vocab_size, seed)
    with torch.no_grad():
        hidden, stats = model.forward_hidden(ids, BaselineView(lengths, CHUNK))
        start, merged = 0, None
        for length in lengths:
            alone, alone_stats = model.forward_hidden(
                ids[start : start + length], BaselineView([length], CHUNK)
            )
            torch.testing.assert_close(hidden[start : start + length], alone, rtol=1e-10, atol=1e-11)
            merged = alone_stats if merged is None else MoEStats.merge(merged, alone_stats)
            start += length
    _assert_stats_close(stats, merged, rtol=1e-10, atol=1e-10)
    assert stats.routed_rows == (sum(lengths) if combination[2] == "moe" else 0)


@pytest.mark.parametrize("combination", [("kda", "mla", "moe"), ("gdn", "gqa", "moe")])
def test_recompute_gives_same_outputs_and_parameter_gradients(combination):
    model = _model(*combination)
    lengths = [17, 9, 32]
    ids = _tokens(lengths, model.config.vocab_size, seed=5)
    target = torch.randn(sum(lengths), model.config.hidden_size, dtype=F64, generator=torch.Generator().manual_seed(6))

    def run(recompute):
        model.zero_grad(set_to_none=True)
        hidden, stats = model.forward_hidden(ids, BaselineView(lengths, CHUNK), recompute=recompute)
        logits = model.logits(hidden)
        loss = (hidden * target).sum() + logits.logsumexp(-1).mean() + z_loss(stats) + load_balancing_loss(stats)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return hidden.detach(), stats, grads

    hidden_plain, stats_plain, grads_plain = run(recompute=False)
    hidden_recomputed, stats_recomputed, grads_recomputed = run(recompute=True)
    torch.testing.assert_close(hidden_recomputed, hidden_plain, rtol=0, atol=0)
    _assert_stats_close(stats_recomputed, stats_plain, rtol=0, atol=0)
    assert grads_plain.keys() == grads_recomputed.keys()
    assert any(".mlp.gate.weight" in name for name in grads_plain)  # the router losses reach the routers
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_recomputed[name], grad, rtol=1e-12, atol=1e-13, msg=name)


def test_checkpointed_blocks_keep_linear_attention_intermediates_in_both_forwards():
    """Under recompute each block's linear-attention calls run inside ``keep_backward_intermediates``, in
    its first forward and in its recompute (the checkpoint drops what the first saves); without recompute
    they do not, so an unchecked pass does not hold every layer's intermediates."""
    from harts.kernels.linear_attention import chunk

    class RecordingView(BaselineView):
        def linear_attention(self, *args, **kwargs):
            seen.append((chunk._keeping.on, torch._C._current_graph_task_id() != -1))
            return super().linear_attention(*args, **kwargs)

    model = _model("kda", "mla", "moe")
    lengths = [17, 9]
    ids = _tokens(lengths, model.config.vocab_size, seed=5)
    linear_layers = sum(kind == "linear" for kind in model.config.layer_types)
    for recompute in (True, False):
        seen = []
        hidden, _ = model.forward_hidden(ids, RecordingView(lengths, CHUNK), recompute=recompute)
        hidden.sum().backward()
        if recompute:
            assert sorted(seen) == [(True, False)] * linear_layers + [(True, True)] * linear_layers
        else:
            assert seen == [(False, False)] * linear_layers
    assert not chunk._keeping.on


@pytest.mark.parametrize("linear,attention,ffn", COMBINATIONS)
def test_every_variant_builds_runs_and_trains(linear, attention, ffn):
    model = _model(linear, attention, ffn, dtype="float32")
    config = model.config
    for layer, kind, mlp_kind in zip(model.layers, config.layer_types, config.mlp_layer_types):
        mixer_class = type(layer.mixer).__name__
        if kind == "linear":
            assert mixer_class == {"kda": "KimiDeltaAttention", "gdn": "GatedDeltaNet"}[linear]
        else:
            assert mixer_class == ("MultiLatentAttention" if attention == "mla" else "FullAttention")
        assert type(layer.mlp).__name__ == ("SparseMoeBlock" if mlp_kind == "moe" else "MLP")
    assert set(config.layer_types) == {"linear", "full"}
    assert ("moe" in config.mlp_layer_types) == (ffn == "moe")

    lengths = [19, 4, 16]
    ids = _tokens(lengths, config.vocab_size, seed=2)
    model.zero_grad(set_to_none=True)
    hidden, stats = model.forward_hidden(ids, BaselineView(lengths, CHUNK))
    logits = model.logits(hidden)
    assert hidden.shape == (sum(lengths), config.hidden_size) and hidden.dtype == torch.float32
    assert logits.shape == (sum(lengths), config.vocab_size)
    assert stats.num_layers == config.num_moe_layers
    (logits.logsumexp(-1).sum() + z_loss(stats) + load_balancing_loss(stats)).backward()
    for name, parameter in model.named_parameters():
        if ".experts." in name:  # an expert no row picked gets no gradient
            continue
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("linear,attention", [("kda", "mla"), ("gdn", "gqa")])
def test_empty_batches_empty_sequences_and_bfloat16(linear, attention):
    model = _model(linear, attention, "moe", n_group=2, topk_group=1)
    hidden, stats = model.forward_hidden(torch.zeros(0, dtype=torch.long), BaselineView([], CHUNK))
    assert hidden.shape == (0, model.config.hidden_size) and stats.tokens.tolist() == [0.0] * 3
    lengths = [0, 5, 0, 3]
    ids = _tokens(lengths, model.config.vocab_size, seed=1)
    with torch.no_grad():
        hidden, _ = model.forward_hidden(ids, BaselineView(lengths, CHUNK))
        alone, _ = model.forward_hidden(ids[:5], BaselineView([5], CHUNK))
    torch.testing.assert_close(hidden[:5], alone, rtol=1e-10, atol=1e-11)

    half = _model(linear, attention, "moe", dtype="bfloat16")
    hidden, stats = half.forward_hidden(ids, BaselineView(lengths, CHUNK))
    assert hidden.dtype == torch.bfloat16 and stats.z_loss_sum.dtype == torch.float32
    half.logits(hidden).float().logsumexp(-1).sum().backward()
    router = next(layer.mlp.gate for layer in half.layers if layer.mlp_type == "moe")
    assert router.weight.dtype == torch.float32 and router.weight.grad is not None


def test_gqa_and_mha_head_counts_follow_the_attention_kind():
    assert HybridConfig.preset("tiny", attention="mha").num_key_value_heads == 4
    assert HybridConfig.preset("tiny", attention="gqa").num_key_value_heads == 2
    assert HybridConfig.preset("tiny", attention="gqa", num_key_value_heads=1).num_key_value_heads == 1
    gqa = HybridConfig.preset("tiny", attention="gqa")
    assert gqa.attention_output_gate and gqa.qk_norm  # Qwen3-Next-style full attention
    mla = HybridConfig.preset("tiny")
    assert not mla.attention_output_gate and not mla.qk_norm


def test_preset_overrides_and_errors():
    config = HybridConfig.preset("tiny", num_layers=6, vocab_size=100)
    assert config.layer_types == ("linear", "full") * 3
    assert config.mlp_layer_types == ("dense",) + ("moe",) * 5
    explicit = HybridConfig.preset("tiny", layer_types=["linear", "linear", "full"])
    assert explicit.num_layers == 3 and explicit.layer_types == ("linear", "linear", "full")
    hf_names = HybridConfig.preset(
        "tiny", layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"]
    )
    assert hf_names.layer_types == ("linear", "full") and hf_names.mlp_layer_types == ("dense", "moe")
    assert HybridConfig.preset("tiny", dtype=torch.float64).torch_dtype == torch.float64
    with pytest.raises(HybridConfigError, match="unknown preset"):
        HybridConfig.preset("huge")
    with pytest.raises(HybridConfigError, match="unknown config field.*hidden"):
        HybridConfig.preset("tiny", hidden=3)
    with pytest.raises(HybridConfigError, match="chunk_size is not a model setting: .* harts.compile"):
        HybridConfig.preset("tiny", chunk_size=8)
    stored = {**HybridConfig.preset("tiny").to_dict(), "chunk_size": 16}  # as older versions wrote it
    assert HybridConfig.from_dict(stored) == HybridConfig.preset("tiny")
    with pytest.raises(HybridConfigError, match="linear must be one of"):
        HybridConfig.preset("tiny", linear="mamba")
    with pytest.raises(HybridConfigError, match="layer_types\\[1\\]"):
        HybridConfig.preset("tiny", layer_types=["linear", "sliding"])
    with pytest.raises(HybridConfigError, match="mla"):
        HybridConfig.preset("tiny", attention="mla", attention_output_gate=True)
    with pytest.raises(HybridConfigError, match="multiple of num_key_value_heads"):
        HybridConfig.preset("tiny", attention="gqa", num_key_value_heads=3)
    with pytest.raises(HybridConfigError, match="num_experts_per_tok"):
        HybridConfig.preset("tiny", num_experts_per_tok=5)
    with pytest.raises(HybridConfigError, match="has 3 entries but num_layers is 4"):
        HybridConfig.preset("tiny", num_layers=4, layer_types=["linear", "linear", "full"])


def _expected_parameter_count(config: HybridConfig) -> tuple[int, int]:
    """(total, active per token) parameters of a KDA + MLA + MoE model, counted from the config."""
    hidden, heads = config.hidden_size, config.linear_num_key_heads
    key_dim, value_dim = heads * config.linear_key_head_dim, heads * config.linear_value_head_dim
    kda = (
        hidden * (2 * key_dim + value_dim)  # q/k/v projections
        + (2 * key_dim + value_dim) * config.linear_conv_kernel_dim  # short conv
        + hidden * config.linear_key_head_dim + config.linear_key_head_dim * key_dim + key_dim + heads  # forget gate
        + hidden * heads  # beta
        + hidden * config.linear_value_head_dim + config.linear_value_head_dim * value_dim  # output gate
        + config.linear_value_head_dim  # output norm
        + value_dim * hidden  # output projection
    )
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    mla = (
        hidden * config.num_attention_heads * qk_dim
        + hidden * (config.kv_lora_rank + config.qk_rope_head_dim)
        + config.kv_lora_rank
        + config.kv_lora_rank * config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim)
        + config.num_attention_heads * config.v_head_dim * hidden
    )
    dense = 3 * hidden * config.intermediate_size
    expert = 3 * hidden * config.moe_intermediate_size
    shared = 3 * hidden * config.shared_expert_intermediate_size
    router = config.num_experts * hidden
    moe_total = config.num_experts * expert + shared + router
    moe_active = config.num_experts_per_tok * expert + shared + router
    norms = 2 * hidden
    total = active = 2 * config.vocab_size * hidden + hidden  # embedding, lm head, final norm
    for kind, mlp_kind in zip(config.layer_types, config.mlp_layer_types):
        mixer = kda if kind == "linear" else mla
        total += mixer + norms + (moe_total if mlp_kind == "moe" else dense)
        active += mixer + norms + (moe_active if mlp_kind == "moe" else dense)
    return total, active


def test_ling_3_0_tiny_preset_has_the_table_1_shape():
    config = HybridConfig.preset("ling-3.0-tiny")
    assert config.num_layers == 24
    assert config.layer_types == ("linear", "linear", "linear", "full") * 6  # 6 x (3 KDA + 1 MLA)
    assert (config.linear, config.attention) == ("kda", "mla")
    assert config.hidden_size == 1536 and config.num_attention_heads == 16 and config.linear_num_key_heads == 16
    assert config.mlp_layer_types == ("dense",) + ("moe",) * 23  # dense layer 1, MoE layers 2-24
    assert config.intermediate_size == 4608
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 512)
    assert config.linear_conv_kernel_dim == 4
    assert config.vocab_size == 157184 and config.torch_dtype == torch.bfloat16

    with torch.device("meta"):  # shapes only: nothing is allocated or run
        model = HybridModel(config)
    total, active = _expected_parameter_count(config)
    assert sum(p.numel() for p in model.parameters()) == total
    assert model.layers[0].mlp.gate_proj.weight.shape == (4608, 1536)
    assert model.layers[1].mlp.experts.gate_up_proj.shape == (128, 2 * 512, 1536)
    assert model.layers[3].self_attn.kv_b_proj.weight.shape[0] == 16 * (128 + 128)
    assert model.layers[0].linear_attn.conv1d.weight.shape[-1] == 4
    assert model.embed_tokens.weight.shape == (157184, 1536)
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32  # router kept in float32 as in HF
    assert 7.0e9 < total < 8.0e9 and 1.0e9 < active < 1.5e9


# --------------------------------------------------------------------------- MoE statistics


def _moe_block(router, seed=0, **overrides):
    torch.manual_seed(seed)
    values = dict(
        dtype="float64", moe_router=router, moe_expert_bias=router == "sigmoid", num_experts=8,
        num_experts_per_tok=3, n_group=4 if router == "sigmoid" else 1, topk_group=2 if router == "sigmoid" else 1,
    )
    config = HybridConfig.preset("tiny", **{**values, **overrides})
    model = HybridModel(config)
    _perturb_biases(model, seed + 1)
    block = model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    return block


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_moe_stats_with_unit_weights_equal_per_token_loops(router):
    block = _moe_block(router)
    x = torch.randn(23, block.gate.weight.shape[1], dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, (z_sum, mass, count, tokens) = block(x, torch.ones(23))
    experts = block.gate.num_experts
    z_ref, mass_ref, count_ref = 0.0, torch.zeros(experts, dtype=F64), torch.zeros(experts, dtype=F64)
    for row in range(23):
        logits = (x[row] @ block.gate.weight.T).detach()  # a reference value, no graph
        z_ref += float(torch.logsumexp(logits, 0)) ** 2
        if router == "softmax":
            probs = torch.softmax(logits, 0)
            chosen = sorted(range(experts), key=lambda e: -float(probs[e]))[:3]
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum()
            biased = scores + block.gate.e_score_correction_bias
            group_scores = [sorted(biased[2 * g : 2 * g + 2].tolist())[-2:] for g in range(4)]
            best_groups = sorted(range(4), key=lambda g: -sum(group_scores[g]))[:2]
            allowed = [e for e in range(experts) if e // 2 in best_groups]
            chosen = sorted(allowed, key=lambda e: -float(biased[e]))[:3]
        mass_ref += probs
        for e in chosen:
            count_ref[e] += 1
        # the block output of this row, from its own routing decision
        weights = probs[chosen] if router == "softmax" else scores[chosen]
        weights = weights / weights.sum() * block.gate.routed_scaling_factor
        expected = sum(
            w * block.experts.down_proj[e] @ (torch.nn.functional.silu(block.experts.gate_up_proj[e][:32] @ x[row])
                                              * (block.experts.gate_up_proj[e][32:] @ x[row]))
            for w, e in zip(weights, chosen)
        )
        expected = expected + block.shared_expert(x[row : row + 1])[0]
        torch.testing.assert_close(y[row], expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(z_sum, torch.tensor(z_ref, dtype=F64), rtol=1e-12, atol=0)
    torch.testing.assert_close(mass, mass_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(count, count_ref, rtol=0, atol=0)
    assert float(tokens) == 23.0


@settings(max_examples=10, deadline=None)
@given(
    multiplicities=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    router=st.sampled_from(["softmax", "sigmoid"]),
)
def test_weighted_stats_equal_stats_of_expanded_rows(multiplicities, router):
    """A compact row with multiplicity q counts like q identical rows, and is computed once."""
    block = _moe_block(router)
    generator = torch.Generator().manual_seed(len(multiplicities))
    x = torch.randn(len(multiplicities), block.gate.weight.shape[1], dtype=F64, generator=generator)
    q = torch.tensor(multiplicities, dtype=torch.float32)
    expanded = x.repeat_interleave(torch.tensor(multiplicities), dim=0)
    with torch.no_grad():
        y, compact_stats = block(x, q)
        y_expanded, expanded_stats = block(expanded, torch.ones(expanded.shape[0]))
    repeats = torch.tensor(multiplicities)
    torch.testing.assert_close(y.repeat_interleave(repeats, dim=0), y_expanded, rtol=1e-12, atol=1e-14)
    for got, want in zip(compact_stats, expanded_stats):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_router_losses_match_hf_load_balancing_and_z_loss_definitions():
    from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

    model = _model("gdn", "gqa", "moe", moe_router="softmax", moe_expert_bias=False, routed_scaling_factor=1.0)
    lengths = [13, 30]
    ids = _tokens(lengths, model.config.vocab_size, seed=9)
    logits_per_layer = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda module, args, out: logits_per_layer.append(out[0].detach()))
        for layer in model.layers
        if layer.mlp_type == "moe"
    ]
    with torch.no_grad():
        _, stats = model.forward_hidden(ids, BaselineView(lengths, CHUNK))
    for hook in hooks:
        hook.remove()
    config = model.config
    per_layer_hf = [
        float(load_balancing_loss_func((logits.float(),), config.num_experts, config.num_experts_per_tok))
        for logits in logits_per_layer
    ]
    assert float(load_balancing_loss(stats)) == pytest.approx(sum(per_layer_hf) / len(per_layer_hf), rel=1e-5)
    z_reference = torch.stack([torch.logsumexp(lg, -1).pow(2).mean() for lg in logits_per_layer]).mean()
    assert float(z_loss(stats)) == pytest.approx(float(z_reference), rel=1e-12)
    assert expert_load(stats).sum(dim=1).tolist() == [sum(lengths) * config.num_experts_per_tok] * stats.num_layers


def test_stats_merge_over_microbatches_equals_the_whole_batch():
    model = _model("kda", "mla", "moe")
    lengths = [12, 7, 20, 3]
    ids = _tokens(lengths, model.config.vocab_size, seed=4)
    with torch.no_grad():
        _, whole = model.forward_hidden(ids, BaselineView(lengths, CHUNK))
        _, first = model.forward_hidden(ids[:19], BaselineView(lengths[:2], CHUNK))
        _, second = model.forward_hidden(ids[19:], BaselineView(lengths[2:], CHUNK))
    merged = MoEStats.merge(first, second)
    _assert_stats_close(merged, whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(z_loss(merged), z_loss(whole), rtol=1e-10, atol=0)
    torch.testing.assert_close(load_balancing_loss(merged), load_balancing_loss(whole), rtol=1e-10, atol=0)
    assert merged.routed_rows == sum(lengths)
    empty = _model("kda", "mla", "dense")
    with torch.no_grad():
        _, none = empty.forward_hidden(ids, BaselineView(lengths, CHUNK))
    assert none.num_layers == 0 and float(z_loss(none)) == 0.0 and float(load_balancing_loss(none)) == 0.0
    with pytest.raises(ValueError, match="same model"):
        MoEStats.merge(whole, none)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_routing_is_deterministic_and_independent_of_the_other_rows(router):
    block = _moe_block(router)
    x = torch.randn(40, block.gate.weight.shape[1], dtype=F64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, _, weights, indices = block.gate(x)
        _, _, weights_again, indices_again = block.gate(x)
        permutation = torch.randperm(40, generator=torch.Generator().manual_seed(1))
        _, _, weights_permuted, indices_permuted = block.gate(x[permutation])
        _, _, weights_half, indices_half = block.gate(x[:17])
        y = block(x, torch.ones(40))[0]
        y_half = block(x[:17], torch.ones(17))[0]
    assert torch.equal(indices, indices_again) and torch.equal(weights, weights_again)
    assert torch.equal(indices[permutation], indices_permuted)
    torch.testing.assert_close(weights[permutation], weights_permuted, rtol=0, atol=0)
    assert torch.equal(indices[:17], indices_half)
    torch.testing.assert_close(y[:17], y_half, rtol=1e-13, atol=1e-15)


def test_expert_bias_changes_selection_but_not_weights():
    block = _moe_block("sigmoid", n_group=1, topk_group=1)
    x = torch.randn(30, block.gate.weight.shape[1], dtype=F64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        block.gate.e_score_correction_bias.zero_()
        block.gate.e_score_correction_bias[5] = 10.0  # expert 5 always selected
        logits, _, weights, indices = block.gate(x)
    assert (indices == 5).any(dim=1).all()
    scores = torch.sigmoid(logits).gather(1, indices)
    torch.testing.assert_close(weights, scores / scores.sum(1, keepdim=True) * block.gate.routed_scaling_factor)


def test_weighted_compact_batch_gives_the_stats_and_bias_update_of_its_expansion():
    """Trajectories repeated q times vs. each run once with row weight q: same MoE statistics and bias step."""
    torch.manual_seed(0)
    config = HybridConfig.preset("tiny", dtype="float64")
    compact_model, expanded_model = HybridModel(config), HybridModel(config)
    expanded_model.load_state_dict(compact_model.state_dict())
    lengths, repeats = [9, 20, 4], [3, 1, 2]
    ids = _tokens(lengths, config.vocab_size, seed=4)
    pieces = torch.split(ids, lengths)
    expanded_ids = torch.cat([piece for piece, count in zip(pieces, repeats) for _ in range(count)])
    expanded_lengths = [length for length, count in zip(lengths, repeats) for _ in range(count)]
    compact_view = BaselineView(lengths, CHUNK)
    compact_view.row_weight = torch.repeat_interleave(
        torch.tensor(repeats, dtype=torch.float32), torch.tensor(lengths)
    )
    with torch.no_grad():
        _, compact = compact_model.forward_hidden(ids, compact_view)
        _, expanded = expanded_model.forward_hidden(expanded_ids, BaselineView(expanded_lengths, CHUNK))
    for field in ("z_loss_sum", "prob_mass", "assign_count", "tokens"):
        torch.testing.assert_close(getattr(compact, field), getattr(expanded, field), rtol=1e-10, atol=1e-10)
    assert compact.routed_rows == sum(lengths) and expanded.routed_rows == sum(expanded_lengths)

    update = apply_expert_bias_update(compact_model, compact, rate=0.01)
    apply_expert_bias_update(expanded_model, expanded, rate=0.01)
    for compact_layer, expanded_layer in zip(compact_model.layers, expanded_model.layers):
        if compact_layer.mlp_type == "moe":
            torch.testing.assert_close(
                compact_layer.mlp.gate.e_score_correction_bias, expanded_layer.mlp.gate.e_score_correction_bias
            )
    load = expert_load(compact)
    mean = load.mean(dim=1, keepdim=True)
    assert torch.equal(update > 0, load < mean) and torch.equal(update < 0, load > mean)
    with pytest.raises(ValueError, match="MoE layer"):
        apply_expert_bias_update(compact_model, MoEStats.empty(config.num_experts), rate=0.01)


def test_config_round_trips_through_a_dict():
    config = HybridConfig.preset("tiny", linear="gdn", attention="gqa", layer_types=["linear", "full", "linear"])
    assert HybridConfig.from_dict(config.to_dict()) == config
    with pytest.raises(HybridConfigError, match="unknown config field"):
        HybridConfig.from_dict({**config.to_dict(), "heads": 3})


# --------------------------------------------------------------------------- RoPE uses trajectory positions


def test_rope_uses_view_positions():
    model = _model("kda", "gqa", "dense")
    lengths = [9, 9]
    ids = _tokens([9], model.config.vocab_size, seed=3).repeat(2)
    with torch.no_grad():
        hidden, _ = model.forward_hidden(ids, BaselineView(lengths, CHUNK))
    # the same tokens at the same trajectory positions give the same rows in both sequences
    torch.testing.assert_close(hidden[:9], hidden[9:], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- parity with the HF implementations


def _load_hf_weights(model: HybridModel, hf_model) -> None:
    state = {}
    for key, value in hf_model.state_dict().items():
        key = key.removeprefix("model.").replace("mlp.shared_experts.", "mlp.shared_expert.")
        parts = key.split(".")
        if parts[0] == "layers" and model.config.layer_types[int(parts[1])] == "linear":
            key = key.replace(".self_attn.", ".linear_attn.")  # Kimi Linear names both mixers self_attn
        state[key] = value
    model.load_state_dict(state, strict=True)


def _randomise_hf(hf_model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in itertools.chain(hf_model.named_parameters(), hf_model.named_buffers()):
            if not tensor.dtype.is_floating_point or "inv_freq" in name:
                continue
            if "norm" in name or "e_score_correction_bias" in name or tensor.abs().sum() == 0:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def test_matches_hf_qwen3_next():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

    hf_config = Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts_per_tok=2, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[0],
    )
    hf_config._experts_implementation = "eager"
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = Qwen3NextForCausalLM(hf_config).double().eval()
    _randomise_hf(hf_model, seed=1)
    config = HybridConfig(
        vocab_size=64, hidden_size=32, num_layers=4, layer_types=hf_config.layer_types,
        mlp_layer_types=["dense", "moe", "moe", "moe"], linear="gdn", attention="gqa", attention_output_gate=True,
        qk_norm=True, partial_rotary_factor=hf_config.rope_parameters["partial_rotary_factor"],
        rope_theta=hf_config.rope_parameters["rope_theta"], norm_zero_centered=True,
        rms_norm_eps=hf_config.rms_norm_eps,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, moe_router="softmax", norm_topk_prob=True,
        shared_expert_intermediate_size=24, shared_expert_gate=True, dtype="float64",
    )
    model = HybridModel(config)
    _load_hf_weights(model, hf_model)
    ids = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(ids).logits[0]
        logits, _ = model(ids[0], BaselineView([19], 4))
    # HF runs its gated-delta core in float32; everything else is float64 on both sides
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)


def test_matches_hf_kimi_linear():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    hf_config = KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
        v_head_dim=8, qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2, num_local_experts=4,
        linear_head_dim=8, linear_num_heads=4, routed_scaling_factor=2.0,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    hf_config._experts_implementation = "eager"
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = KimiLinearForCausalLM(hf_config).double().eval()
    _randomise_hf(hf_model, seed=2)
    config = HybridConfig(
        vocab_size=64, hidden_size=32, num_layers=3, layer_types=hf_config.layer_types,
        mlp_layer_types=hf_config.mlp_layer_types, linear="kda", attention="mla", use_rope=False,
        mla_latent_norm_eps=1e-6, rms_norm_eps=hf_config.rms_norm_eps, linear_num_key_heads=4,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_attention_heads=4,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, moe_router="sigmoid", moe_expert_bias=True,
        n_group=2, topk_group=1, routed_scaling_factor=2.0, norm_topk_prob=True, shared_expert_intermediate_size=16,
        dtype="float64",
    )
    model = HybridModel(config)
    _load_hf_weights(model, hf_model)
    ids = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids).logits[0]
        logits, _ = model(ids[0], BaselineView([19], 4))
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
def test_mla_with_rope_and_low_rank_q_matches_hf_deepseek_v3(interleave):
    """The Ling-style MLA path (RoPE on the rope dims, optional low-rank q) and grouped sigmoid routing."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

    hf_config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=8,
        qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
        norm_topk_prob=True, rope_interleave=interleave, pad_token_id=0,
    )
    hf_config._experts_implementation = "eager"
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = DeepseekV3ForCausalLM(hf_config).double().eval()
    _randomise_hf(hf_model, seed=1)
    config = HybridConfig(
        vocab_size=64, hidden_size=32, num_layers=2, layer_types=["full", "full"], mlp_layer_types=["dense", "moe"],
        attention="mla", use_rope=True, rope_interleave=interleave, rope_theta=hf_config.rope_parameters["rope_theta"],
        q_lora_rank=12, mla_latent_norm_eps=1e-6, rms_norm_eps=hf_config.rms_norm_eps, num_attention_heads=4,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48,
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, moe_router="sigmoid", moe_expert_bias=True,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, shared_expert_intermediate_size=16, dtype="float64",
    )
    model = HybridModel(config)
    _load_hf_weights(model, hf_model)
    ids = torch.randint(0, 64, (1, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids).logits[0]
        logits, _ = model(ids[0], BaselineView([23], 64))
    # HF computes router logits in float32; the rest is float64 on both sides
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)


def test_forward_hidden_rejects_mismatched_rows_and_ids():
    model = _model()
    with pytest.raises(ValueError, match="view has 5"):
        model.forward_hidden(torch.zeros(4, dtype=torch.long), BaselineView([5], CHUNK))
    with pytest.raises(ValueError, match="input_ids must lie in"):
        model.forward_hidden(torch.full((5,), 256), BaselineView([5], CHUNK))


def test_tied_embeddings_share_the_weight():
    torch.manual_seed(0)
    model = HybridModel(HybridConfig.preset("tiny", tie_word_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize(("linear", "value_heads"), [("kda", 2), ("gdn", 4)])
def test_linear_conv_channels_are_the_layers_convolution_channels(linear, value_heads):
    config = HybridConfig.preset("tiny", linear=linear, linear_num_key_heads=2, linear_num_value_heads=value_heads,
                                 linear_key_head_dim=8, linear_value_head_dim=6)
    convolutions = [m for m in HybridModel(config).modules() if type(m).__name__ == "ShortConvolution"]
    assert convolutions and all(m.channels == config.linear_conv_channels for m in convolutions)
