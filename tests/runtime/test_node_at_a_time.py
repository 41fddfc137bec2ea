"""The node-at-a-time linear-attention ablation (Tree Training's schedule on a compiled plan).

* With every node start on the chunk grid its log-probs equal the baseline's (float64).
* With forks anywhere they equal the no-replay oracle: every trajectory expanded and run
  through the reference kernels with the chunk grid restarted at the forks of its
  microbatch's trie (``NoReplayView``), forward and parameter gradients (float64).
* It issues exactly one linear-attention call per trie node of the microbatch, parents
  first, and reports that count.
"""

from __future__ import annotations

import functools
import types
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import harts
from harts.errors import PlanningError
from harts.kernels import dispatch
from harts.runtime import HybridConfig, HybridModel, log_probs_baseline, microbatch_log_probs
from harts_bench.ablation import NodeAtATimeView, NoReplayView, TrieNodes, fork_positions
from tests.helpers import chunk_aligned_token_trees, forked_trajectories, token_trees

CHUNK = 8
VOCAB = 512
EXACT = 1e-10
#: float32 round-off of one log-prob of the tiny model (seen: 5e-7 to 1.5e-6, AVX2 and AVX-512)
FLOAT32_ROUNDING = 2e-5


@functools.cache
def tiny_model(linear: str = "kda", dtype: str = "float64") -> HybridModel:
    torch.manual_seed(0)
    return HybridModel(HybridConfig.preset("tiny", vocab_size=VOCAB, linear=linear, dtype=dtype))


def compile_plan(trajectories, fraction: float = 1.0):
    """A plan of the batch; ``fraction`` < 1 lowers the capacity so that it may take several microbatches."""
    batch = harts.RolloutBatch.from_trajectories(trajectories)
    capacity = max(max(len(t) for t in trajectories), int(fraction * batch.semantic_tokens))
    try:
        return batch, harts.compile(batch, capacity=capacity, chunk_size=CHUNK)
    except PlanningError:
        assume(False)


def fork_free_runs(token_lists) -> int:
    """Nodes of the token trie of ``token_lists`` when only forks split a run: the distinct prefixes
    ``t[:p + 1]`` with p == 0 or with two or more distinct tokens following ``t[:p]``."""
    continuations = defaultdict(set)
    for tokens in token_lists:
        for p in range(len(tokens)):
            continuations[tuple(tokens[:p])].add(tokens[p])
    return len({tuple(t[: p + 1]) for t in token_lists for p in range(len(t)) if p == 0 or len(continuations[tuple(t[:p])]) > 1})


def no_replay_log_probs(model, batch, plan) -> dict[int, torch.Tensor]:
    """The oracle: per microbatch, its trajectories expanded, the chunk grid restarted at the forks of the
    microbatch's own trie (computed from scratch on the member subset), log-probs per trajectory."""
    out = {}
    for microbatch in plan.module.microbatches:
        members = sorted(microbatch.trajectories)
        sub = batch.subset(members)
        cuts = fork_positions(harts.compile(sub, pipeline="prefix-compress").module.trie)
        lengths = [len(t) for t in sub.tokens]
        ids = torch.as_tensor(np.concatenate(sub.tokens), dtype=torch.long)
        hidden, _ = model.forward_hidden(ids, NoReplayView(lengths, cuts, CHUNK))
        for trajectory, tokens, rows in zip(members, sub.tokens, hidden.split(lengths)):
            log_probs = torch.log_softmax(model.logits(rows[:-1]).double(), -1)
            out[trajectory] = log_probs.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return out


def parameter_grads(model, log_probs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    loss = sum((lp * torch.randn(lp.shape, generator=generator, dtype=lp.dtype).to(lp.device)).sum() for lp in log_probs)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.detach().double() - y.detach().double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


# ----------------------------------------------------------------------------- (a) on the chunk grid


@given(trajectories=chunk_aligned_token_trees(chunk_size=CHUNK, max_trajectories=7, max_length=36),
       fraction=st.sampled_from([1.0, 0.4]))
def test_node_starts_on_the_chunk_grid_reproduce_the_baseline(trajectories, fraction):
    batch, plan = compile_plan(trajectories, fraction)
    for microbatch in range(len(plan.module.microbatches)):
        assert np.all(TrieNodes.from_layout(plan.layout(microbatch)).position % CHUNK == 0)
    model = tiny_model()
    node = harts.runtime.log_probs(model, plan, batch, view_type=NodeAtATimeView)
    baseline = log_probs_baseline(model, batch, microbatches=plan)
    assert max_diff(node.log_probs, baseline.log_probs) < EXACT


# ----------------------------------------------------------------------------- (b) forks anywhere


@settings(max_examples=15)
@given(trajectories=token_trees(chunk_size=CHUNK, max_trajectories=7, max_length=36),
       fraction=st.sampled_from([1.0, 0.4]), seed=st.integers(0, 3))
def test_forks_anywhere_equal_the_no_replay_oracle_forward_and_gradients(trajectories, fraction, seed):
    batch, plan = compile_plan(trajectories, fraction)
    model = tiny_model()
    node = harts.runtime.log_probs(model, plan, batch, view_type=NodeAtATimeView).log_probs
    oracle_by_trajectory = no_replay_log_probs(model, batch, plan)
    oracle = [oracle_by_trajectory[i] for i in range(len(batch.tokens))]
    assert max_diff(node, oracle) < EXACT
    assert max_diff(parameter_grads(model, node, seed), parameter_grads(model, oracle, seed)) < EXACT


def forked_batch():
    """Two-level forks just before, on and after a chunk boundary and mid-chunk."""
    return forked_trajectories(CHUNK)


@pytest.mark.parametrize("linear", ["kda", "gdn"])
def test_chained_states_are_differentiable_and_recompute_gives_the_same_gradients(linear):
    batch, plan = compile_plan(forked_batch())
    assert any(TrieNodes.from_layout(plan.layout(0)).position % CHUNK), "some node starts off the chunk grid"
    model = tiny_model(linear)
    plain = harts.runtime.log_probs(model, plan, batch, view_type=NodeAtATimeView).log_probs
    recomputed = harts.runtime.log_probs(model, plan, batch, recompute=True, view_type=NodeAtATimeView).log_probs
    oracle_by_trajectory = no_replay_log_probs(model, batch, plan)
    oracle = [oracle_by_trajectory[i] for i in range(len(batch.tokens))]
    assert max_diff(plain, oracle) < EXACT
    grads = parameter_grads(model, plain, 0)
    assert max_diff(grads, parameter_grads(model, oracle, 0)) < EXACT
    assert max_diff(grads, parameter_grads(model, recomputed, 0)) < 1e-12
    assert max(float(g.abs().max()) for g in grads) > 0


def test_float32_differs_from_the_baseline_only_by_rounding():
    """Off the grid the floating-point path is the no-replay one: not the baseline's, but within rounding."""
    batch, plan = compile_plan(forked_batch())
    model = tiny_model(dtype="float32")
    with torch.no_grad():
        node = harts.runtime.log_probs(model, plan, batch, view_type=NodeAtATimeView).packed
        replay = harts.runtime.log_probs(model, plan, batch).packed
        baseline = log_probs_baseline(model, batch, microbatches=plan).packed
    # each bounded on its own: which path rounds closer to the baseline depends on the CPU's vector width
    assert float((node - baseline).abs().max()) < FLOAT32_ROUNDING
    assert float((replay - baseline).abs().max()) < FLOAT32_ROUNDING


# ----------------------------------------------------------------------------- (c) one call per trie node


def counting_kernels():
    calls = []

    def chunk_linear_attention(*args, **kwargs):
        calls.append(int(args[5][-1]))  # rows of the call, from its cu_seqlens
        return dispatch.chunk_linear_attention(*args, **kwargs)

    kernels = types.SimpleNamespace(
        chunk_linear_attention=chunk_linear_attention, recurrent_linear_attention=dispatch.recurrent_linear_attention,
        causal_conv1d=dispatch.causal_conv1d, attention=dispatch.attention,
    )
    return kernels, calls


@given(trajectories=token_trees(chunk_size=CHUNK, max_trajectories=8, max_length=36), fraction=st.sampled_from([1.0, 0.4]))
def test_one_call_per_trie_node_parents_first(trajectories, fraction):
    batch, plan = compile_plan(trajectories, fraction)
    model = tiny_model(dtype="float32")
    linear_layers = model.config.num_linear_layers
    for microbatch in plan.module.microbatches:
        layout = plan.layout(microbatch.index)
        nodes = TrieNodes.from_layout(layout)
        expected = fork_free_runs([batch.tokens[i].tolist() for i in microbatch.trajectories])
        assert nodes.num_nodes == expected == len(microbatch.segments)
        assert NodeAtATimeView(layout).linear_attention_calls == expected

        # nodes tile the rows in order; a child starts where its parent ends, after it in the call order
        assert np.array_equal(nodes.row_start, np.concatenate([[0], np.cumsum(nodes.length)[:-1]]))
        assert int(nodes.length.sum()) == layout.num_rows
        rank = np.empty(nodes.num_nodes, dtype=np.int64)
        rank[nodes.order] = np.arange(nodes.num_nodes)
        children = np.flatnonzero(nodes.parent >= 0)
        assert np.all(rank[nodes.parent[children]] < rank[children])
        assert np.array_equal(nodes.position[children], nodes.position[nodes.parent[children]] + nodes.length[nodes.parent[children]])
        assert np.all(nodes.position[nodes.parent < 0] == 0)

        kernels, calls = counting_kernels()
        with torch.no_grad():
            microbatch_log_probs(model, plan, batch, microbatch.index, kernels=kernels, view_type=NodeAtATimeView)
        assert len(calls) == expected * linear_layers
        assert calls == nodes.length[nodes.order].tolist() * linear_layers


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fast_kernels_match_the_reference_node_at_a_time():
    """The fla path chains fp32 final states (and their gradients) like the reference does."""
    from harts.kernels import Dispatch
    from harts.kernels.linear_attention.chunk import fla_available

    if not fla_available():
        pytest.skip("flash-linear-attention is not installed")
    chunk = 32  # fla's KDA kernels take chunk sizes 32 and 64
    batch = harts.RolloutBatch.from_trajectories(forked_trajectories(chunk))
    plan = harts.compile(batch, capacity=65536, chunk_size=chunk)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = HybridModel(HybridConfig.preset("tiny", vocab_size=VOCAB, dtype="float32"))
    results = {}
    for mode in ("naive", "fast"):
        log_probs = harts.runtime.log_probs(model, plan, batch, recompute=True, kernels=Dispatch(mode),
                                            view_type=NodeAtATimeView).log_probs
        results[mode] = (log_probs, parameter_grads(model, log_probs, 0))
    grads_scale = max(float(g.abs().max()) for g in results["naive"][1])
    # fla runs fp32 operands of its dots as tf32
    assert max_diff(results["fast"][0], results["naive"][0]) < 2e-2
    assert max_diff(results["fast"][1], results["naive"][1]) < 2e-2 * grads_scale
