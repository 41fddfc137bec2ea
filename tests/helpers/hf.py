"""Hugging Face test helpers: tiny Qwen3-Next / Kimi Linear configs and log-probs of both implementations."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import sys

import pytest
import torch

from harts.runtime import log_probs
import harts


transformers = pytest.importorskip("transformers")


_ACCELERATED = ("fla", "causal_conv1d")
_MODELING = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.kimi_linear.modeling_kimi_linear",
)


def _import_torch_only_modeling():
    """The two modeling modules, imported (or re-imported) while the accelerated kernels are unimportable."""
    missing = object()
    saved = {name: sys.modules.get(name, missing) for name in _ACCELERATED}
    accelerated_loaded = any(isinstance(module, type(sys)) for module in saved.values())
    for name in _ACCELERATED:
        sys.modules[name] = None  # makes `import name` raise ImportError
    try:
        modules = []
        for name in _MODELING:
            module = importlib.import_module(name)
            if accelerated_loaded:
                # imported earlier with the accelerated kernels available: bind the torch ones
                module = importlib.reload(module)
            modules.append(module)
    finally:
        for name, module in saved.items():
            if module is missing:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return modules


QWEN, KIMI = _import_torch_only_modeling()


class _TorchWithoutDowncast:
    """``torch`` as the modeling modules see it inside :func:`transformers_in_float64`."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def transformers_in_float64():
    original_float = torch.Tensor.float
    torch.Tensor.float = lambda self, memory_format=torch.preserve_format: self.to(
        torch.float64, memory_format=memory_format
    )
    for module in (QWEN, KIMI):
        module.torch = _TorchWithoutDowncast()
    try:
        yield
    finally:
        torch.Tensor.float = original_float
        for module in (QWEN, KIMI):
            module.torch = torch


def _perturb(model, seed: int, scale: float = 0.3) -> None:
    """Move what transformers initialises to constants away from them (norms, expert biases, decay biases, conv)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            if not tensor.dtype.is_floating_point or "inv_freq" in name:
                continue
            if "norm" in name or "e_score_correction_bias" in name or "conv1d" in name or "dt_bias" in name:
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensor.add_((scale * noise).to(tensor.dtype))


def _finish(model, dtype, seed, slow_decay: bool, perturb: bool = True):
    """Eager attention and experts (transformers' reference paths), perturbed weights, cast to ``dtype``."""
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    if perturb:
        _perturb(model, seed)
    if slow_decay:
        # Gated DeltaNet with fast random decays is ill-conditioned (float32 round-off of both
        # implementations reaches ~5e-4 against float64); slower decays keep float32 meaningful.
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, QWEN.Qwen3NextGatedDeltaNet):
                    rates = torch.empty(module.A_log.shape).uniform_(0.01, 0.1, generator=generator)
                    module.A_log.copy_(rates.log())
    model = model.to(dtype).eval()
    if dtype == torch.float64:
        rotary = getattr(model.model, "rotary_emb", None)
        if rotary is not None:
            # the float64 RoPE table that transformers' own formula gives without its float32 cast
            with transformers_in_float64():
                rotary.inv_freq = rotary.compute_default_rope_parameters(model.config)[0]
    return model


def qwen3_next_config(init=0.35, **overrides):
    values = dict(
        vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts_per_tok=2, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[0], initializer_range=init,
        layer_types=["linear_attention", "full_attention", "linear_attention"], pad_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    )
    values.update(overrides)
    return transformers.Qwen3NextConfig(**values)


def kimi_linear_config(init=0.35, **overrides):
    values = dict(
        vocab_size=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4,
        v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=3, num_local_experts=8,
        linear_head_dim=8, linear_num_heads=4, routed_scaling_factor=2.0, initializer_range=init,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    values.update(overrides)
    return transformers.KimiLinearConfig(**values)


def tiny_hf_model(architecture: str, dtype: torch.dtype = torch.float64, slow_decay: bool | None = None):
    """The tiny transformers model of ``architecture`` ("qwen3_next" or "kimi_linear") from seed 0, finished as
    the equivalence tests use it (:func:`_finish`; slow decays by default outside float64). Not cached:
    callers that reuse one cache it themselves, since some adjust it."""
    torch.manual_seed(0)
    if architecture == "qwen3_next":
        model = QWEN.Qwen3NextForCausalLM(qwen3_next_config())
    else:
        model = KIMI.KimiLinearForCausalLM(kimi_linear_config())
    slow_decay = dtype != torch.float64 if slow_decay is None else slow_decay
    return _finish(model, dtype, seed=0, slow_decay=slow_decay)


def reference_log_probs(model, trajectories) -> list[torch.Tensor]:
    """Per trajectory, on its own: transformers forward -> log_softmax -> log-prob of each next token."""
    out = []
    context = transformers_in_float64() if model.dtype == torch.float64 else contextlib.nullcontext()
    with context:
        for tokens in trajectories:
            ids = torch.tensor(tokens, dtype=torch.long)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0]
            log_probs_all = torch.log_softmax(logits, dim=-1)
            out.append(log_probs_all[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


def harts_log_probs(model, trajectories, *, chunk_size=16, dp_size=1, capacity=None):
    batch = harts.RolloutBatch.from_trajectories(trajectories)
    longest = max(len(t) for t in trajectories)
    capacity = max(longest, capacity or batch.semantic_tokens)
    plan = harts.compile(batch, capacity=capacity, dp_size=min(dp_size, len(trajectories)), chunk_size=chunk_size)
    return log_probs(model, plan, batch), plan


def mean_log_prob_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    diffs = [(g.detach().double() - w.detach().double()).abs() for g, w in zip(got, want) if len(w)]
    return float(torch.cat(diffs).mean()) if diffs else 0.0


def max_log_prob_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    return max((float((g - w).detach().abs().max()) for g, w in zip(got, want) if len(w)), default=0.0)
