"""harts.interop.to_layout: every framework layout held to a hand expansion of the baseline log-probs.

The hand expansions below loop over trajectories and index the per-trajectory log-probs
(``values[i][t] = log p(tokens_i[t+1] | tokens_i[:t+1])``) one entry at a time, following each
framework's own convention as cited in :mod:`harts.interop.framework_layouts`. The layouts of a compiled
plan's output and of the baseline's output must both match, values, entropies and gradients.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.interop import LAYOUTS, LayoutError, layout_spec, to_layout
from harts.runtime import log_probs, log_probs_baseline
from tests.helpers import token_trees
from tests.helpers import tiny_model


CHUNK = 4


def hand_verl(values, lengths, prompts, width):
    out = torch.zeros(len(values), width, dtype=values[0].dtype)
    for i, (value, length, prompt) in enumerate(zip(values, lengths, prompts)):
        for j in range(length - prompt):
            out[i, j] = value[prompt + j - 1]  # the log-prob of response token j = token P + j
    return out


def hand_nemo(values, lengths, total):
    out = torch.zeros(len(values), total - 1, dtype=values[0].dtype)
    for i, (value, length) in enumerate(zip(values, lengths)):
        for t in range(length - 1):
            out[i, t] = value[t]  # column t scores input_ids[t + 1]
    return out


def hand_areal(values, lengths):
    out = []
    for value, length in zip(values, lengths):
        for t in range(length):
            # entry t: log p(token t + 1 | tokens <= t), as AReaL's engine gathers at roll(input_ids, -1)
            out.append(value[t] if t < length - 1 else torch.zeros((), dtype=value.dtype))
    return torch.stack(out)


def hand_nested(values, lengths):
    rows = []
    for value, length in zip(values, lengths):
        rows.append(torch.stack([value[t] if t < length - 1 else torch.zeros((), dtype=value.dtype) for t in range(length)]))
    return rows


def hand(name, values, batch, prompts, width):
    lengths = batch.lengths.tolist()
    if name in ("verl", "trl"):
        return hand_verl(values, lengths, prompts, width)
    if name == "nemo":
        return hand_nemo(values, lengths, width)
    if name == "areal":
        return hand_areal(values, lengths)
    return hand_nested(values, lengths)


def hand_flat(name, values, batch, prompts, width):
    expanded = hand(name, values, batch, prompts, width)
    return torch.cat(expanded) if isinstance(expanded, list) else expanded.reshape(-1)


def default_width(name, batch, prompts):
    lengths = batch.lengths
    return {"verl": int((lengths - prompts).max()), "trl": int((lengths - prompts).max()), "nemo": int(lengths.max())}.get(name)


def flat(tensor):
    return tensor.values() if tensor.is_nested else tensor.reshape(-1)


@st.composite
def batches_with_prompts(draw):
    trajectories = draw(token_trees(chunk_size=CHUNK, max_trajectories=6, max_length=18, vocab=5))
    prompts = [draw(st.integers(1, len(t))) for t in trajectories]
    return trajectories, prompts


@settings(max_examples=20, deadline=None)
@given(case=batches_with_prompts(), extra=st.integers(0, 2))
def test_every_layout_equals_the_hand_expansion_of_the_baseline(case, extra, single_thread):
    trajectories, prompts = case
    model = tiny_model()
    batch = harts.RolloutBatch.from_trajectories(trajectories, prompt_length=prompts)
    plan = harts.compile(batch, capacity=max(map(len, trajectories)) + 8, chunk_size=CHUNK)
    out = log_probs(model, plan, batch, with_entropy=True)
    ref = log_probs_baseline(model, batch, microbatches=plan, with_entropy=True)
    lengths = batch.lengths
    for name in LAYOUTS:
        width = None if default_width(name, batch, prompts) is None else default_width(name, batch, prompts) + extra
        for entropy, source in ((False, "log_probs"), (True, "entropy")):
            got_ref = to_layout(ref, batch, name, entropy=entropy, width=width)
            got_out = to_layout(out, batch, name, entropy=entropy, width=width)
            if name == "nested":
                assert [len(r) for r in got_out.unbind()] == lengths.tolist()
            else:
                assert got_out.shape == hand(name, getattr(out, source), batch, prompts, width).shape
            want_ref = hand_flat(name, getattr(ref, source), batch, prompts, width)
            want_out = hand_flat(name, getattr(out, source), batch, prompts, width)
            assert torch.equal(flat(got_ref), want_ref)  # pure indexing: exact
            assert torch.equal(flat(got_out), want_out)
            torch.testing.assert_close(flat(got_out), want_ref, rtol=0, atol=1e-10)


def test_layouts_are_differentiable_like_the_hand_expansion(single_thread):
    trajectories = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 2], [3, 3]]
    prompts = [3, 3, 5, 1]
    model = tiny_model()
    batch = harts.RolloutBatch.from_trajectories(trajectories, prompt_length=prompts)
    plan = harts.compile(batch, capacity=64, chunk_size=CHUNK)
    generator = torch.Generator().manual_seed(0)
    parameters = [p for p in model.parameters() if p.requires_grad]
    for name in LAYOUTS:
        out = log_probs(model, plan, batch, with_entropy=True)
        ref = log_probs_baseline(model, batch, with_entropy=True)
        layout = flat(to_layout(out, batch, name)) + 0.5 * flat(to_layout(out, batch, name, entropy=True))
        weights = torch.randn(layout.shape, generator=generator, dtype=layout.dtype)
        # gradient into the log-probs: the layout is a gather, its adjoint a scatter-add
        (grad,) = torch.autograd.grad((weights * layout).sum(), out.packed, retain_graph=True)
        width = default_width(name, batch, prompts)
        expanded = hand_flat(name, out.log_probs, batch, prompts, width) + 0.5 * hand_flat(name, out.entropy, batch, prompts, width)
        (want,) = torch.autograd.grad((weights * expanded).sum(), out.packed, retain_graph=True)
        assert torch.equal(grad, want)
        # and into the model, as the trajectory-wise baseline's layout does
        got = torch.autograd.grad((weights * layout).sum(), parameters, allow_unused=True)
        ref_layout = flat(to_layout(ref, batch, name)) + 0.5 * flat(to_layout(ref, batch, name, entropy=True))
        expected = torch.autograd.grad((weights * ref_layout).sum(), parameters, allow_unused=True)
        for g, e in zip(got, expected):
            if e is not None:
                torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-10)


def test_token_fields_share_the_slots_of_the_log_probs():
    batch = harts.RolloutBatch.from_trajectories(
        [[5, 6, 7, 8], [5, 6, 9]], prompt_length=[2, 1], old_log_probs=[[0.0, 0.1, 0.2, 0.3], [0.0, 0.4, 0.5]],
    )
    old = batch.token_fields["old_log_probs"]
    verl = layout_spec(batch, "verl")
    assert torch.equal(verl.token_field(old), torch.tensor([[0.2, 0.3], [0.4, 0.5]], dtype=torch.float64))
    assert torch.equal(verl.mask, torch.tensor([[True, True], [True, True]]))
    assert torch.equal(verl.token_field(batch.loss_mask), torch.ones(2, 2))
    nemo = layout_spec(batch, "nemo", width=5)
    assert torch.equal(nemo.token_field(old), torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.4, 0.5, 0.0, 0.0]], dtype=torch.float64))
    assert torch.equal(nemo.mask, torch.tensor([[True, True, True, False], [True, True, False, False]]))
    areal = layout_spec(batch, "areal")
    assert areal.cu_seqlens.tolist() == [0, 4, 7] and areal.cu_seqlens.dtype == torch.int32
    assert torch.equal(areal.token_field(old), torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4, 0.5, 0.0], dtype=torch.float64))
    nested = layout_spec(batch, "nested")
    assert [r.tolist() for r in nested.token_field(old).unbind()] == [[0.1, 0.2, 0.3, 0.0], [0.4, 0.5, 0.0]]
    assert [r.tolist() for r in nested.mask.unbind()] == [[True, True, True, False], [True, True, False]]


def test_layout_errors_name_the_problem():
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4, 5]])
    values = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(LayoutError, match="unknown layout 'megatron'"):
        to_layout(values, batch, "megatron")
    with pytest.raises(LayoutError, match="prompt_length"):
        to_layout(values, batch, "verl")
    with pytest.raises(LayoutError, match="trajectory 1: field 'prompt_length' is 0"):
        to_layout(values, batch, "trl", prompt_lengths=[1, 0])
    with pytest.raises(LayoutError, match="width 1 is too small: trajectory 1 needs 3"):
        to_layout(values, batch, "verl", prompt_lengths=[1, 1], width=1)
    with pytest.raises(LayoutError, match="trajectory 1: \\(2,\\) values, expected 3"):
        to_layout([torch.zeros(2), torch.zeros(2)], batch, "areal")
    with pytest.raises(LayoutError, match="with_entropy=True"):
        to_layout(log_probs_baseline(tiny_model(), batch), batch, "nemo", entropy=True)


def test_an_output_computed_for_another_batch_is_refused():
    """Same lengths, rows swapped: laid out against the wrong batch, every value would land on the wrong trajectory."""
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3], [4, 5, 6]], prompt_length=[1, 1])
    swapped = harts.RolloutBatch.from_trajectories([[4, 5, 6], [1, 2, 3]], prompt_length=[1, 1])
    out = log_probs_baseline(tiny_model(), batch)
    assert out.input_hash == batch.input_hash()
    with pytest.raises(LayoutError, match="computed for batch .* not for this batch"):
        to_layout(out, swapped, "verl")
    later = harts.RolloutBatch.from_trajectories([[1, 2, 3], [4, 5, 6]], prompt_length=[1, 1], advantages=[0.5, -0.5])
    torch.testing.assert_close(to_layout(out, later, "verl"), to_layout(out, batch, "verl"), rtol=0, atol=0)
