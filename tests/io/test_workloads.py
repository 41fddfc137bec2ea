"""Workload generators: the SWE-like step, the bundled demo batch and input specs."""

from __future__ import annotations

import importlib.resources

import numpy as np
import pytest

from harts import RolloutBatch
from harts.errors import RolloutInputError
from harts.rollouts import write_node_table
from harts.passes.prefix_compress import build_compact_trie, sorted_order_and_lcp
from harts.rollouts.inputs import demo_batch, resolve_input
from harts.rollouts.workloads import (
    MAX_TRAJECTORY_TOKENS,
    grpo_advantages,
    make_demo_batch,
    swe_like_step,
    swe_like_steps,
    trees_near_compression,
    trie_compression,
    with_compression,
)


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


def distinct_prefixes(tokens: tuple[np.ndarray, ...]) -> int:
    """Brute-force compact token count: the number of distinct non-empty token prefixes."""
    return len({t[: k + 1].tobytes() for t in tokens for k in range(len(t))})


def runs(mask: np.ndarray, value: float) -> list[int]:
    """Lengths of maximal runs of ``value`` in ``mask``."""
    padded = np.concatenate([[False], mask == value, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return (edges[1::2] - edges[::2]).tolist()


# ----------------------------------------------------------------------------- SWE-like


@pytest.fixture(scope="module")
def full_step() -> RolloutBatch:
    return swe_like_step(0)


def test_full_scale_step_matches_the_paper_workload(full_step):
    batch = full_step
    raw = batch.semantic_tokens
    compact = build_compact_trie(batch.tokens).compact_tokens
    assert 1_200 <= len(batch) <= 1_900
    assert 30e6 <= raw <= 50e6
    assert 5.0 <= raw / compact <= 6.3
    assert batch.lengths.max() < 65_536 and batch.lengths.max() <= MAX_TRAJECTORY_TOKENS
    assert batch.lengths.min() < 10_000 and batch.lengths.max() > 50_000
    paths_per_task = np.bincount(batch.tree_ids)
    assert 80 <= len(paths_per_task) <= 120
    assert paths_per_task.min() <= 5 and paths_per_task.max() >= 40


def test_calibrated_profile_plans_like_the_papers_recorded_steps():
    # The paper's Table 2 steps: 1.3k-2.4k paths, 35-59M raw tokens, planned compression
    # 5.0-7.6x at T = 65,536; its slot counts give microbatches about 98% full.
    from harts.ir.prefix_index import PrefixIndex
    from harts.passes.base import PassContext
    from harts.passes.lower import lower
    from harts.passes.prefix_compress import PrefixCompress
    from harts.planner import PlannerOptions, choose_microbatches

    batch = swe_like_step(seed=1, profile="calibrated")
    assert 1_300 <= len(batch) <= 2_400
    assert 35e6 <= batch.semantic_tokens <= 59e6
    module = PrefixCompress().run(lower(batch, capacity=65_536, dp_size=4), PassContext(batch=batch))
    result = choose_microbatches(PrefixIndex.from_module(module), PlannerOptions(capacity=65_536, dp_size=4))
    assert 5.0 <= batch.semantic_tokens / sum(result.works) <= 7.6
    assert sum(result.works) / len(result.works) >= 0.95 * 65_536
    # the default profile's large trees are the contrast: a plan there repeats long stems
    assert swe_like_step(seed=1, scale=0.05).content_hash() == swe_like_step(seed=1, scale=0.05, profile="large-trees").content_hash()


def test_full_scale_step_forks_around_chunk_boundaries(full_step):
    batch = full_step
    _, lcps = sorted_order_and_lcp(batch.tokens)
    residues = np.asarray(lcps) % 64
    for residue in (63, 0, 1):
        assert (residues == residue).sum() >= 5
    # Forks also fall inside chunks, not only on turn boundaries.
    assert len(set(residues.tolist())) == 64


def test_full_scale_turn_lengths(full_step):
    batch = full_step
    assistant, tool = [], []
    for mask in batch.loss_mask[:300]:
        assistant += runs(mask, 1.0)
        tool += runs(mask, 0.0)[1:]  # the first run of zeros is the prompt
    assistant, tool = np.asarray(assistant), np.asarray(tool)
    assert assistant.max() <= 800 and np.mean(assistant >= 50) > 0.98
    assert tool.max() <= 4_000 and np.mean(tool >= 100) > 0.98


@pytest.mark.parametrize("target", [5.0, 5.6])
def test_trees_near_compression_keeps_whole_trees_near_the_target(target):
    full = swe_like_step(seed=1, scale=0.25, vocab_size=1000)
    budget, capacity = 250_000, 65_536
    subset = trees_near_compression(full, budget, target, capacity)
    assert subset.semantic_tokens <= budget
    chosen = set(np.asarray(subset.tree_ids).tolist())
    full_ids = np.asarray(full.tree_ids)
    # whole trees, in generation order, each within capacity once compressed
    assert len(subset) == int(np.isin(full_ids, list(chosen)).sum())
    assert list(subset.tree_ids) == sorted(subset.tree_ids)
    for tree in chosen:
        members = tuple(full.tokens[i] for i in np.flatnonzero(full_ids == tree))
        assert build_compact_trie(members).compact_tokens <= capacity
    joint = subset.semantic_tokens / build_compact_trie(subset.tokens).compact_tokens
    # this step has trees on both sides of the target, so the joint sharing lands close to it
    assert abs(joint - target) <= 0.03 * target
    assert len(chosen) >= 2


def test_trees_near_compression_errors_name_the_reason():
    full = swe_like_step(seed=1, scale=0.05, vocab_size=1000)
    with pytest.raises(RolloutInputError, match="no rollout tree has a compact size within capacity 100"):
        trees_near_compression(full, 10**9, 3.0, 100)
    with pytest.raises(RolloutInputError, match="'target' must be at least 1"):
        trees_near_compression(full, 10**9, 0.5, 65_536)


@pytest.fixture(scope="module")
def shared_trees() -> RolloutBatch:
    full = swe_like_step(seed=1, scale=0.25, vocab_size=1000)
    return trees_near_compression(full, 250_000, 5.6, 65_536)


@pytest.mark.parametrize("target", [1.0, 1.5, 2.0, 3.0])
def test_with_compression_reaches_low_sharing(shared_trees, target):
    assert trie_compression(shared_trees) > 4.0  # whole trees alone share far more than the targets
    lowered = with_compression(shared_trees, target, vocab_size=1000, seed=3)
    compact = distinct_prefixes(lowered.tokens) if target == 1.0 else build_compact_trie(lowered.tokens).compact_tokens
    assert abs(lowered.semantic_tokens / compact - target) <= 0.01 * target
    # only sharing changes: the same trajectories, lengths, fields and token count
    assert np.array_equal(lowered.lengths, shared_trees.lengths)
    assert lowered.semantic_tokens == shared_trees.semantic_tokens
    for name, values in shared_trees.token_fields.items():
        assert all(np.array_equal(a, b) for a, b in zip(values, lowered.token_fields[name]))
    for name, values in shared_trees.trajectory_fields.items():
        assert np.array_equal(values, lowered.trajectory_fields[name])
    changed = [i for i, (a, b) in enumerate(zip(shared_trees.tokens, lowered.tokens)) if not np.array_equal(a, b)]
    for i in changed:  # one token per changed trajectory, within the vocabulary
        assert int((shared_trees.tokens[i] != lowered.tokens[i]).sum()) == 1
        assert 0 <= int(lowered.tokens[i].max()) < 1000
    if target == 1.0:
        assert len(set(np.asarray(lowered.tree_ids).tolist())) == len(lowered)


def test_with_compression_is_seeded_and_errors_name_the_reason(shared_trees):
    once = with_compression(shared_trees, 2.0, vocab_size=1000, seed=5)
    again = with_compression(shared_trees, 2.0, vocab_size=1000, seed=5)
    assert once.content_hash() == again.content_hash()
    with pytest.raises(RolloutInputError, match="'target' must be at least 1"):
        with_compression(shared_trees, 0.9, vocab_size=1000)
    with pytest.raises(RolloutInputError, match="sharing can only be lowered"):
        with_compression(shared_trees, 50.0, vocab_size=1000)


def test_with_compression_aims_at_the_given_measure(shared_trees):
    import harts

    def planned(batch):
        return harts.compile(batch, capacity=32_768, verify=False).stats["compression"]

    lowered = with_compression(shared_trees, 2.0, vocab_size=1000, measure=planned)
    assert abs(planned(lowered) - 2.0) <= 0.02


def test_small_step_structure():
    batch = swe_like_step(seed=5, scale=0.05)
    assert set(batch.token_fields) == {"loss_mask"}
    assert set(batch.trajectory_fields) == {"group_id", "reward", "advantage"}
    assert np.unique(batch.tree_ids).tolist() == list(range(5))
    np.testing.assert_array_equal(batch.trajectory_fields["group_id"], batch.tree_ids)
    rewards = batch.trajectory_fields["reward"]
    assert set(rewards.tolist()) <= {0.0, 1.0}
    for group in np.unique(batch.tree_ids):
        members = batch.tree_ids == group
        expected = (rewards[members] - rewards[members].mean()) / (rewards[members].std() + 1e-6)
        np.testing.assert_allclose(batch.trajectory_fields["advantage"][members], expected)
    for tokens, mask in zip(batch.tokens, batch.loss_mask):
        assert tokens.dtype == np.int64 and tokens.min() >= 0 and tokens.max() < 151_000
        assert mask.dtype == np.float32 and set(np.unique(mask).tolist()) <= {0.0, 1.0}
        assert mask[0] == 0.0 and mask.any()
    # One system prompt for every task; task prompts differ, so trees meet only there.
    first = [np.flatnonzero(batch.tree_ids == tree)[0] for tree in range(5)]
    system = {lcp(batch.tokens[a], batch.tokens[b]) for a in first for b in first if a != b}
    assert len(system) == 1
    system_length = system.pop()
    assert 100 <= system_length <= 200
    assert all(not m[:system_length].any() for m in batch.loss_mask)
    for tree in range(5):
        members = np.flatnonzero(batch.tree_ids == tree)
        assert all(lcp(batch.tokens[members[0]], batch.tokens[i]) > system_length for i in members)


def test_steps_are_deterministic_and_seeded():
    a = swe_like_step(seed=7, scale=0.02)
    b = swe_like_step(seed=7, scale=0.02)
    assert a.content_hash() == b.content_hash()
    assert swe_like_step(seed=8, scale=0.02).content_hash() != a.content_hash()
    steps = swe_like_steps(count=2, scale=0.02)
    assert [s.content_hash() for s in steps] == [swe_like_step(seed, scale=0.02).content_hash() for seed in (1, 2)]


@pytest.mark.parametrize("scale", [0.001, 0.01])
def test_tiny_scales_still_make_valid_batches(scale):
    batch = swe_like_step(seed=1, scale=scale, vocab_size=50)
    assert len(np.unique(batch.tree_ids)) == 1
    assert batch.lengths.min() >= 1
    assert max(int(t.max()) for t in batch.tokens) < 50
    assert build_compact_trie(batch.tokens).compact_tokens == distinct_prefixes(batch.tokens)


def test_bad_generator_options():
    with pytest.raises(RolloutInputError, match="option 'scale' must be positive"):
        swe_like_step(scale=0)
    with pytest.raises(RolloutInputError, match="option 'vocab_size' must be at least 2"):
        swe_like_step(vocab_size=1)
    with pytest.raises(RolloutInputError, match="unknown profile 'paper'; profiles: large-trees, calibrated"):
        swe_like_step(profile="paper")


def test_grpo_advantages_single_member_groups_are_zero():
    advantages = grpo_advantages(np.array([1.0, 0.0, 1.0]), np.array([0, 1, 1]))
    np.testing.assert_allclose(advantages, [0.0, -0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)])


# ----------------------------------------------------------------------------- demo


def test_bundled_demo_equals_its_generator(tmp_path):
    generated = make_demo_batch()
    bundled = demo_batch()
    assert bundled.content_hash() == generated.content_hash()
    resource = importlib.resources.files("harts.data").joinpath("demo_rollouts.jsonl")
    rewritten = tmp_path / "demo_rollouts.jsonl"
    write_node_table(generated, rewritten)
    assert rewritten.read_bytes() == resource.read_bytes()
    assert len(resource.read_bytes()) < 300_000


def test_demo_shape():
    batch = make_demo_batch()
    assert len(np.unique(batch.tree_ids)) == 6
    assert 30 <= len(batch) <= 40
    assert batch.lengths.min() >= 40 and batch.lengths.max() <= 400
    assert max(int(t.max()) for t in batch.tokens) < 1000
    assert set(batch.token_fields) == {"loss_mask", "rollout_logprobs"}
    assert set(batch.trajectory_fields) == {"group_id", "reward", "advantage"}

    def tree(index):
        return [batch.tokens[i] for i in np.flatnonzero(batch.tree_ids == index)]

    def fork_points(trajectories):
        return {lcp(a, b) for i, a in enumerate(trajectories) for b in trajectories[i + 1:]}

    # Two trees share the system prompt; the others share nothing with anyone.
    assert lcp(tree(0)[0], tree(1)[0]) >= 32
    for other in range(2, 6):
        assert all(lcp(tree(other)[0], tree(t)[0]) == 0 for t in range(6) if t != other)
    assert {63, 64, 65, 127, 128} <= fork_points(tree(0))
    in_one_chunk = [p for p in fork_points(tree(1)) if 64 < p < 128]
    assert len(in_one_chunk) >= 4
    assert {191, 192, 193} <= fork_points(tree(5))
    prefix_pairs = [
        (i, j)
        for i, a in enumerate(batch.tokens)
        for j, b in enumerate(batch.tokens)
        if i != j and len(a) < len(b) and lcp(a, b) == len(a)
    ]
    assert prefix_pairs
    # Same tokens with different loss masks at shared positions.
    duplicates = [
        (i, j)
        for i, a in enumerate(batch.tokens)
        for j, b in enumerate(batch.tokens)
        if i < j and len(a) == len(b) and np.array_equal(a, b)
    ]
    assert any(not np.array_equal(batch.loss_mask[i], batch.loss_mask[j]) for i, j in duplicates)


def test_demo_compact_tokens_match_brute_force():
    batch = make_demo_batch()
    compact = build_compact_trie(batch.tokens).compact_tokens
    assert compact == distinct_prefixes(batch.tokens)
    assert batch.semantic_tokens / compact > 1.5


def test_demo_is_deterministic_per_seed():
    assert make_demo_batch(0).content_hash() == make_demo_batch(0).content_hash()
    assert make_demo_batch(1).content_hash() != make_demo_batch(0).content_hash()


# ----------------------------------------------------------------------------- input specs


def test_resolve_presets_and_paths(tmp_path):
    assert resolve_input("demo").content_hash() == make_demo_batch().content_hash()
    small = resolve_input("swe-like:seed=3,scale=0.01")
    assert small.content_hash() == swe_like_step(seed=3, scale=0.01).content_hash()
    assert resolve_input("swe-like: seed=3 , scale=0.01, vocab_size=100").content_hash() == swe_like_step(3, 0.01, 100).content_hash()
    calibrated = resolve_input("swe-like:seed=3,scale=0.01,profile=calibrated")
    assert calibrated.content_hash() == swe_like_step(3, 0.01, profile="calibrated").content_hash() != small.content_hash()
    for suffix in (".jsonl", ".parquet"):
        path = tmp_path / f"small{suffix}"
        write_node_table(small, path)
        assert resolve_input(str(path)).content_hash() == small.content_hash()
        assert resolve_input(path).content_hash() == small.content_hash()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("swe_like", "neither a node table (.jsonl, .parquet) nor a preset; presets: demo, grpo, no-sharing, swe-like, wide-tree"),
        ("rollouts.csv", "presets: demo, grpo, no-sharing, swe-like, wide-tree"),
        ("swe-like:seed=3,size=2", "preset 'swe-like': unknown option 'size=2'; options: seed, scale, vocab_size"),
        ("swe-like:seed", "preset 'swe-like': unknown option 'seed'"),
        ("swe-like:seed=x", "preset 'swe-like': option 'seed' must be int, got 'x'"),
        ("demo:seed=1", "preset 'demo': unknown option 'seed=1'; options: none"),
        ("missing.jsonl", "no such node-table file"),
    ],
)
def test_resolve_errors(spec, message):
    with pytest.raises(RolloutInputError) as error:
        resolve_input(spec)
    assert message in str(error.value)
