"""harts.models.share_hf: HARTS computes on a transformers model's own parameters, in place.

The tiny Qwen3-Next and Kimi Linear models of ``tests/runtime/test_hf_models.py``. What holds:
the HARTS model's tensors are the transformers model's tensor objects (nothing is stored
twice); it computes exactly what a copy (``from_hf``) computes; an optimizer step taken on the
transformers parameters is what the next HARTS pass sees; a HARTS backward fills the
transformers parameters' ``.grad`` with the gradient transformers' own backward gives.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import harts
from harts.models import HFModelError, from_hf, hf_key_map, is_shared, share_hf
from harts.runtime import log_probs
from tests.helpers import token_trees
from tests.helpers.hf import KIMI, QWEN, _finish, kimi_linear_config, qwen3_next_config, reference_log_probs, transformers_in_float64

CHUNK = 8
ARCHITECTURES = ["qwen3_next", "kimi_linear", "qwen3_next_tied"]


def transformers_model(architecture: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    if architecture == "kimi_linear":
        model = KIMI.KimiLinearForCausalLM(kimi_linear_config())
    else:
        tied = architecture == "qwen3_next_tied"
        model = QWEN.Qwen3NextForCausalLM(qwen3_next_config(tie_word_embeddings=tied))
    return _finish(model, dtype, seed=seed, slow_decay=dtype != torch.float64)


def plan_log_probs(model, trajectories):
    batch = harts.RolloutBatch.from_trajectories(trajectories)
    capacity = max(max(len(t) for t in trajectories), batch.semantic_tokens)
    plan = harts.compile(batch, capacity=capacity, chunk_size=CHUNK)
    return log_probs(model, plan, batch)


TREE = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [3, 1, 4, 1, 5, 9, 2, 6, 7, 7, 1], [3, 1, 4, 20, 21], [3, 1]]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_shared_model_holds_the_transformers_tensors(architecture):
    hf = transformers_model(architecture)
    model = share_hf(hf)
    assert is_shared(model, hf)
    names = hf_key_map(model)
    theirs = hf.state_dict(keep_vars=True)
    ours = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    assert set(ours) == set(names)
    for name, tensor in ours.items():
        assert tensor is theirs[names[name]], name
        assert not tensor.is_meta and tensor.data_ptr() == theirs[names[name]].data_ptr()
    # no storage of its own: every byte the HARTS model reads is a transformers tensor's
    storages = {t.untyped_storage().data_ptr() for t in ours.values()}
    assert storages <= {t.untyped_storage().data_ptr() for t in theirs.values()}
    if architecture == "qwen3_next_tied":
        assert model.lm_head.weight is model.embed_tokens.weight is hf.lm_head.weight
    copy = from_hf(hf)
    assert not is_shared(copy, hf)


@settings(max_examples=10, deadline=None)
@given(trajectories=token_trees(chunk_size=CHUNK, max_trajectories=4, max_length=24, vocab=6), architecture=st.sampled_from(ARCHITECTURES))
def test_the_shared_model_computes_what_a_copy_computes(trajectories, architecture):
    hf = transformers_model(architecture)
    shared, copy = share_hf(hf), from_hf(hf)
    with torch.no_grad():
        got, want = plan_log_probs(shared, trajectories), plan_log_probs(copy, trajectories)
    assert torch.equal(got.packed, want.packed)
    assert torch.equal(got.moe.prob_mass, want.moe.prob_mass)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_an_optimizer_step_on_the_transformers_parameters_is_what_the_next_pass_sees(architecture):
    hf = transformers_model(architecture)
    shared = share_hf(hf)
    with torch.no_grad():
        before = plan_log_probs(shared, TREE).packed.clone()
    optimizer = torch.optim.SGD(hf.parameters(), lr=0.5)
    loss = -sum(lp.sum() for lp in reference_log_probs(hf, TREE))
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = plan_log_probs(shared, TREE).packed
        expected = plan_log_probs(from_hf(hf), TREE).packed  # a copy of the stepped weights
    assert torch.equal(after, expected)
    assert float((after - before).abs().max()) > 1e-3
    assert is_shared(shared, hf)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_harts_backward_fills_the_transformers_grads_with_transformers_gradient(architecture):
    """Float64, transformers' float32 downcasts lifted (see test_hf_models.py): one random weighting of the log-probs."""
    hf = transformers_model(architecture, torch.float64)
    shared = share_hf(hf)
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(t) - 1, generator=generator, dtype=torch.float64) for t in TREE]

    hf.zero_grad(set_to_none=True)
    with transformers_in_float64():
        want = reference_log_probs(hf, TREE)
        sum((w * lp).sum() for w, lp in zip(weights, want)).backward()
    expected = {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}

    hf.zero_grad(set_to_none=True)
    out = plan_log_probs(shared, TREE)
    (torch.cat(weights) * out.packed).sum().backward()
    got = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}

    assert set(got) == set(expected)
    floor = 1e-8 * max(float(g.abs().max()) for g in expected.values())
    for name, grad in got.items():
        error = float((grad - expected[name]).abs().max())
        assert error <= 1e-6 * max(float(expected[name].abs().max()), floor), name


def test_what_from_hf_refuses_share_hf_refuses():
    hf = transformers_model("qwen3_next")
    hf.model.adapter = nn.Linear(4, 4)  # state HARTS has no counterpart for (as an adapter would add)
    with pytest.raises(HFModelError, match="model.adapter"):
        share_hf(hf)


def test_replacing_the_transformers_tensors_ends_the_sharing():
    hf = transformers_model("kimi_linear")
    shared = share_hf(hf)
    fresh = {key: value.clone() for key, value in hf.state_dict().items()}
    hf.load_state_dict(fresh, assign=True)
    assert not is_shared(shared, hf)
