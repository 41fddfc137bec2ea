"""harts.interop.from_verl / from_trl / from_areal: framework dict -> RolloutBatch -> plan -> layout.

The batch dicts are built the way each framework builds them (``tests/helpers/frameworks.py``),
from multi-turn agent episodes with tool tokens. Without a model, the property tests check that
importing and laying out again reproduces the framework's own positions exactly (tokens,
masks, label-aligned values). With a model, the log-probs HARTS computes on a compiled plan and
lays out for the framework equal the framework's own trajectory-wise numbers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.errors import RolloutInputError
from harts.interop import from_areal, from_trl, from_verl, layout_spec, to_layout
from harts.runtime import log_probs, log_probs_baseline
from tests.helpers import (
    GARBAGE,
    agent_episodes,
    areal_packed,
    areal_padded,
    areal_rows,
    fixed_episodes,
    trl_batch,
    verl_batch,
)
from tests.helpers import tiny_model


CHUNK = 4


def random_values(episodes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=len(tokens) - 1) for tokens, _, _ in episodes]


def assert_episodes(batch, episodes):
    assert [t.tolist() for t in batch.tokens] == [tokens for tokens, _, _ in episodes]
    assert batch.trajectory_fields["prompt_length"].tolist() == [p for _, _, p in episodes]
    assert [m.tolist() for m in batch.loss_mask] == [[float(g) for g in generated] for _, generated, _ in episodes]


def valid(values, mask):
    """The entries at the framework's valid positions."""
    values = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
    return values[torch.as_tensor(np.asarray(mask)).bool()]


# ------------------------------------------------------------------------ exact positions


@settings(max_examples=40, deadline=None)
@given(episodes=agent_episodes(), extra=st.integers(0, 3))
def test_verl_positions_round_trip_exactly(episodes, extra):
    values = random_values(episodes)
    d = verl_batch(episodes, values, extra_width=extra)
    batch = from_verl(d)
    assert_episodes(batch, episodes)
    width = d["responses"].shape[1]
    spec = layout_spec(batch, "verl", width=width)
    assert torch.equal(spec.mask, torch.as_tensor(d["attention_mask"][:, -width:]).bool())
    assert torch.equal(spec.token_field(batch.loss_mask), torch.as_tensor(d["response_mask"], dtype=torch.float32))
    laid_out = to_layout([torch.as_tensor(v) for v in values], batch, "verl", width=width)
    assert torch.equal(valid(laid_out, spec.mask).float(), valid(d["old_log_probs"], spec.mask))
    assert torch.equal(spec.token_field(batch.token_fields["old_log_probs"]), torch.as_tensor(np.where(spec.mask, d["old_log_probs"], 0)))
    assert torch.equal(spec.token_field(batch.token_fields["advantages"]), torch.as_tensor(d["advantages"]))
    assert batch.trajectory_fields["uid"].tolist() == d["uid"].tolist()


@settings(max_examples=40, deadline=None)
@given(episodes=agent_episodes(), extra=st.integers(0, 3))
def test_trl_positions_round_trip_exactly(episodes, extra):
    values = random_values(episodes)
    d = trl_batch(episodes, values, extra_width=extra)
    batch = from_trl(d)
    assert_episodes(batch, episodes)  # loss_mask = completion_mask * tool_mask on the completion
    width = d["completion_ids"].shape[1]
    spec = layout_spec(batch, "trl", width=width)
    assert torch.equal(spec.mask, torch.as_tensor(d["completion_mask"]).bool())
    assert torch.equal(spec.token_field(batch.loss_mask), torch.as_tensor(d["completion_mask"] * d["tool_mask"], dtype=torch.float32))
    laid_out = to_layout([torch.as_tensor(v) for v in values], batch, "trl", width=width)
    assert torch.equal(valid(laid_out, spec.mask), valid(d["old_per_token_logps"], spec.mask))
    assert np.array_equal(batch.trajectory_fields["advantages"], d["advantages"])
    assert "num_items_in_batch" not in batch.trajectory_fields  # a batch-level count


@settings(max_examples=40, deadline=None)
@given(episodes=agent_episodes(), form=st.sampled_from(["rows", "padded", "packed"]))
def test_areal_positions_round_trip_exactly(episodes, form):
    values = random_values(episodes)
    rows = areal_rows(episodes, values)
    padded = areal_padded(rows)
    packed = areal_packed(padded)
    d = {"rows": {k: [r[k] for r in rows] if k != "rewards" else np.array([r[k] for r in rows]) for k in rows[0]},
         "padded": padded, "packed": packed}[form]
    batch = from_areal(d, rolled=False)
    assert_episodes(batch, episodes)
    spec = layout_spec(batch, "areal")
    assert torch.equal(spec.cu_seqlens, torch.as_tensor(packed["cu_seqlens"]))

    def rolled(key):  # what PPOActor.compute_advantages makes of a token-aligned field: rolled by -1 per row
        return torch.as_tensor(np.concatenate([np.roll(row, -1) for row in d_rows[key]]))

    d_rows = {key: [r[key] for r in rows] for key in ("loss_mask", "logprobs", "versions")}
    generated = rolled("loss_mask").bool()
    laid_out = to_layout([torch.as_tensor(v, dtype=torch.float32) for v in values], batch, "areal")
    assert torch.equal(laid_out[generated], rolled("logprobs")[generated])
    assert torch.equal(spec.token_field(batch.loss_mask).bool(), generated)
    assert torch.equal(spec.token_field(batch.token_fields["rollout_logprobs"])[generated], rolled("logprobs")[generated])
    assert torch.equal(spec.token_field(batch.token_fields["versions"])[spec.mask], rolled("versions")[spec.mask])
    assert np.array_equal(batch.trajectory_fields["rewards"], packed["rewards"])


def test_areal_engine_outputs_and_rolled_batches_are_shifted_to_token_alignment():
    episodes = fixed_episodes()
    values = random_values(episodes)
    padded = areal_padded(areal_rows(episodes, values))
    token_aligned = [np.asarray(t) for t in from_areal(padded, rolled=False).token_fields["rollout_logprobs"]]
    # prox_logp from the engine: entry t scores token t + 1 (gathered at roll(input_ids, -1))
    engine = dict(padded, prox_logp=np.roll(padded["logprobs"], -1, axis=1))
    batch = from_areal(engine, rolled=False)
    for mine, want in zip(batch.token_fields["old_log_probs"], token_aligned):
        assert np.array_equal(mine, want)
    # after PPOActor.compute_advantages: loss_mask and logprobs rolled by -1, advantages next-token aligned
    rolled = {k: (np.roll(v, -1, axis=1) if k in ("loss_mask", "logprobs") else v) for k, v in padded.items()}
    rolled["advantages"] = np.roll(padded["loss_mask"].astype(np.float32), -1, axis=1) * 2.0
    after = from_areal(rolled, rolled=True)
    assert [m.tolist() for m in after.loss_mask] == [[float(g) for g in generated] for _, generated, _ in episodes]
    for mine, mask in zip(after.token_fields["advantages"], after.loss_mask):
        assert np.array_equal(mine, 2.0 * mask)
    assert from_areal(rolled, rolled=False).loss_mask[0].tolist() != after.loss_mask[0].tolist()


# ------------------------------------------------------------------------ with a model


def framework_log_probs(model, episodes):
    """What the framework's own trajectory-wise forward computes: one sequence at a time."""
    out = []
    for tokens, _, _ in episodes:
        single = harts.RolloutBatch.from_trajectories([tokens])
        out.append(log_probs_baseline(model, single).log_probs[0].detach().numpy())
    return out


@pytest.mark.parametrize("framework", ["verl", "trl", "areal"])
def test_plan_log_probs_in_the_framework_layout_equal_the_framework_forward(framework, single_thread):
    model = tiny_model(vocab_size=128)
    episodes = fixed_episodes()
    values = framework_log_probs(model, episodes)
    if framework == "verl":
        d = verl_batch(episodes, values)
        batch, key, width = from_verl(d), "old_log_probs", d["responses"].shape[1]
        mask = d["attention_mask"][:, -width:]
    elif framework == "trl":
        d = trl_batch(episodes, values)
        batch, key, width = from_trl(d), "old_per_token_logps", d["completion_ids"].shape[1]
        mask = d["completion_mask"]
    else:
        d = areal_packed(areal_padded(areal_rows(episodes, values)))
        batch, key, width = from_areal(d, rolled=False), "logprobs", None
        # AReaL's loss reads next-token-aligned log-probs beside the loss mask rolled by -1 per trajectory
        cu = d["cu_seqlens"]
        d = dict(d, **{k: np.concatenate([np.roll(d[k][a:b], -1) for a, b in zip(cu[:-1], cu[1:])]) for k in ("logprobs", "loss_mask")})
        mask = d["loss_mask"]
    plan = harts.compile(batch, capacity=60, chunk_size=CHUNK)
    assert plan.stats["compact_tokens"] < plan.stats["semantic_tokens"]  # the rollouts share prompts and turns
    assert plan.stats["num_microbatches"] > 1
    out = log_probs(model, plan, batch)
    laid_out = to_layout(out, batch, framework, width=width)
    assert laid_out.shape == torch.as_tensor(d[key]).shape
    torch.testing.assert_close(valid(laid_out, mask), valid(d[key], mask).to(laid_out.dtype), rtol=0, atol=1e-6)
    # the same layout of the baseline on the imported batch
    ref = log_probs_baseline(model, batch, microbatches=plan)
    torch.testing.assert_close(to_layout(ref, batch, framework, width=width), laid_out, rtol=0, atol=1e-10)


# ------------------------------------------------------------------------ bad input


def test_importers_name_the_row_and_key():
    episodes = fixed_episodes()
    values = random_values(episodes)
    d = verl_batch(episodes, values)
    broken = dict(d, attention_mask=d["attention_mask"].copy())
    width = d["responses"].shape[1]
    broken["attention_mask"][2, -width + 1] = 0  # a hole inside row 2's response
    with pytest.raises(RolloutInputError, match="row 2: attention_mask of the response is not right-padded"):
        from_verl(broken)
    broken = dict(d, responses=d["responses"].copy())
    broken["responses"][1, 0] += 1
    with pytest.raises(RolloutInputError, match="row 1: 'responses' column 0 differs"):
        from_verl(broken)
    broken = dict(d, position_ids=d["position_ids"] + 1)
    with pytest.raises(RolloutInputError, match="row 0: 'position_ids'"):
        from_verl(broken)
    odd = dict(d, teacher_logits=np.zeros((len(episodes), 3, 2, 2)))
    with pytest.raises(RolloutInputError, match="cannot place 'teacher_logits'"):
        from_verl(odd)
    assert "teacher_logits" not in from_verl(odd, ignore=["teacher_logits"]).token_fields
    with pytest.raises(RolloutInputError, match="missing required key 'responses'"):
        from_verl({k: v for k, v in d.items() if k != "responses"})
    t = trl_batch(episodes, values)
    broken = dict(t, prompt_mask=t["prompt_mask"].copy())
    broken["prompt_mask"][3, -1] = 0
    with pytest.raises(RolloutInputError, match="row 3: prompt_mask is not left-padded"):
        from_trl(broken)
    a = areal_packed(areal_padded(areal_rows(episodes, values)))
    with pytest.raises(RolloutInputError, match="'cu_seqlens'"):
        from_areal(dict(a, cu_seqlens=a["cu_seqlens"][:-1]), rolled=False)
    assert GARBAGE not in np.concatenate(from_verl(d).token_fields["old_log_probs"])  # padding never leaks in


def test_sequence_level_fields_are_per_trajectory_and_nan_log_probs_are_refused():
    """vLLM's sequence-level ``importance_sampling_ratio`` [B, 1] is one value per trajectory; a NaN in a
    log-prob field (TRL's sampling log-probs) is refused naming the row and field."""
    episodes = fixed_episodes()
    values = random_values(episodes)
    t = trl_batch(episodes, values)
    ratio = np.linspace(0.5, 1.5, len(episodes))[:, None]
    batch = from_trl(dict(t, importance_sampling_ratio=ratio))
    np.testing.assert_array_equal(batch.trajectory_fields["importance_sampling_ratio"], ratio[:, 0])
    sampling = t["old_per_token_logps"].copy()
    sampling[1, 0] = np.nan
    with pytest.raises(RolloutInputError, match=r"trl batch: row 1 \(trajectory 1\): field 'rollout_logprobs' entry .* is nan"):
        from_trl(dict(t, sampling_per_token_logps=sampling))
    with pytest.raises(RolloutInputError, match="trajectory 2: field 'importance_sampling_ratio' is inf"):
        from_trl(dict(t, importance_sampling_ratio=np.where(np.arange(len(episodes)) == 2, np.inf, 1.0)[:, None]))
