"""Compact physical layout (§4.2) and the torch.fx programs generated from it.

Layouts are checked against brute force over token prefixes: a row is a distinct token
prefix of the microbatch, its multiplicity the number of members sharing that prefix. The
generated programs are checked against a direct eager implementation of the rounds and
against every trajectory expanded and run on its own (the baseline).
"""

from __future__ import annotations

import types

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.codegen.fx import attention_kv_rows, build_linear_attention_program, render_programs
from harts.codegen.layout import MicrobatchLayout, build_layout
from harts.errors import IRVerificationError, PlanArtifactError
from harts.ir.nodes import Phase, StateRef
from harts.ir.verify import verify
from harts.kernels import naive
from harts.kernels.rows.packed import contiguous_span
from harts.passes import PassContext
from harts.passes.lay_out import LayOut
from harts.passes.manager import run_pipeline
from harts.runtime.tree_view import TreeView
from harts.runtime.view import BaselineView
from tests.helpers import batches_with_groups, figure_batch, nested_forks_batch, rounded_module


# ------------------------------------------------------------------------------ layout


def _prefix(batch, trajectory, length):
    return tuple(batch.tokens[trajectory][:length].tolist())


def check_layout(batch, module, layout: MicrobatchLayout):
    microbatch = module.microbatches[layout.microbatch]
    members = list(microbatch.trajectories)
    B = module.chunk_size
    row_key = [_prefix(batch, int(t), int(p) + 1) for t, p in zip(layout.row_trajectory, layout.row_position)]
    # rows are exactly the distinct token prefixes of the members
    prefixes = {_prefix(batch, i, t + 1) for i in members for t in range(len(batch.tokens[i]))}
    assert layout.num_rows == len(prefixes) == microbatch.work
    assert len(set(row_key)) == layout.num_rows
    # the map m and the multiplicities
    assert list(layout.trajectories) == sorted(members)
    for i in members:
        rows = layout.rows_of_trajectory(i)
        assert len(rows) == len(batch.tokens[i])
        for t, r in enumerate(rows):
            assert layout.row_position[r] == t
            assert row_key[r] == _prefix(batch, i, t + 1)
    counts = {key: sum(1 for i in members if _prefix(batch, i, len(key)) == key and len(batch.tokens[i]) >= len(key)) for key in row_key}
    assert [counts[k] for k in row_key] == list(layout.row_multiplicity)
    assert layout.row_multiplicity.sum() == sum(len(batch.tokens[i]) for i in members)
    # physical order: round, then sequence, then position; a sequence's rows are contiguous
    assert np.all(np.diff(layout.seq_round) >= 0)
    assert list(layout.round_seq_start) == [0, *np.cumsum([len(r.sequences) for r in microbatch.rounds])]
    for j in range(layout.num_sequences):
        rows = layout.sequence_rows(j)
        assert list(layout.row_position[rows]) == list(range(layout.seq_start[j], layout.seq_end[j]))
        assert np.all(layout.row_trajectory[rows] == layout.seq_trajectory[j])
        ancestors = layout.ancestor_rows_of(j)
        assert len(ancestors) == layout.seq_start[j]
        assert [row_key[r] for r in ancestors] == [_prefix(batch, int(layout.seq_trajectory[j]), p + 1) for p in range(len(ancestors))]
        exports = layout.exports_of(j)
        chunks = layout.export_chunk[layout.export_offsets[j] : layout.export_offsets[j + 1]]
        assert list(chunks) == [(p - layout.seq_replay_start[j]) // B for p in exports]
        assert all(p % B == 0 and layout.seq_replay_start[j] < p <= layout.seq_end[j] for p in exports)
        source = layout.seq_state_source[j]
        if source < 0:
            assert layout.seq_replay_start[j] == 0 and layout.seq_state_export[j] == -1
            continue
        position = layout.seq_replay_start[j]
        assert layout.seq_round[source] < layout.seq_round[j]
        assert layout.export_position[layout.seq_state_export[j]] == position
        assert layout.export_offsets[source] <= layout.seq_state_export[j] < layout.export_offsets[source + 1]
        assert layout.seq_state_chunk[j] == (position - layout.seq_replay_start[source]) // B
        assert _prefix(batch, int(layout.seq_trajectory[source]), position) == _prefix(batch, int(layout.seq_trajectory[j]), position)
    assert layout.replay_tokens == microbatch.replay_tokens
    # input ids come from the batch tokens
    assert [k[-1] for k in row_key] == list(layout.input_ids(batch.tokens))


@settings(max_examples=40, deadline=None)
@given(batches_with_groups())
def test_layout_matches_brute_force_prefixes(case):
    batch, chunk_size, groups = case
    module = rounded_module(batch, chunk_size, groups)
    for microbatch in module.microbatches:
        check_layout(batch, module, build_layout(module, microbatch.index))


@settings(max_examples=15, deadline=None)
@given(batches_with_groups())
def test_layout_tensors_round_trip_and_are_deterministic(case):
    batch, chunk_size, groups = case
    module = rounded_module(batch, chunk_size, groups)
    for microbatch in module.microbatches:
        first = build_layout(module, microbatch.index).to_tensors()
        second = build_layout(rounded_module(batch, chunk_size, groups), microbatch.index).to_tensors()
        assert list(first) == list(second)
        for key in first:
            assert first[key].dtype == np.int64
            assert first[key].tobytes() == second[key].tobytes()
        restored = MicrobatchLayout.from_tensors(first).to_tensors()
        assert all(np.array_equal(restored[key], first[key]) for key in first)


def test_figure_batch_has_replay_exports_and_two_rounds():
    batch = figure_batch()
    module = rounded_module(batch, 4)
    layout = build_layout(module, 0)
    check_layout(batch, module, layout)
    assert layout.num_rounds >= 2 and layout.num_exports >= 1 and layout.replay_tokens > 0
    assert layout.num_rows < batch.semantic_tokens


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_nested_forks_inside_one_chunk_and_trees_sharing_a_prompt(chunk_size):
    batch = nested_forks_batch()
    for groups in (None, [[0, 2, 3, 7], [1, 4, 5, 6, 8]]):
        module = rounded_module(batch, chunk_size, groups)
        for microbatch in module.microbatches:
            check_layout(batch, module, build_layout(module, microbatch.index))


def test_zero_state_sequence_in_a_later_round():
    """A round mixing zero-state and handed-over sequences (legal, though Alg. 1 never makes one)."""
    batch = figure_batch()
    module = rounded_module(batch, 4)
    microbatch = module.microbatches[0]
    first, *rest = microbatch.rounds
    mover = next(s for s in first.sequences if s.state_from is None and not s.exports and s.trajectory == 6)
    rounds = [attrs.evolve(first, sequences=tuple(s for s in first.sequences if s is not mover))]
    rounds.append(attrs.evolve(rest[0], sequences=rest[0].sequences + (mover,)))
    rounds.extend(rest[1:])
    moved = attrs.evolve(module, microbatches=(attrs.evolve(microbatch, rounds=tuple(rounds)),))
    verify(moved)
    layout = build_layout(moved, 0)
    check_layout(batch, moved, layout)
    program = build_linear_attention_program(layout)
    assert "zero_state_round1" in program.code
    operands = random_operands(layout.num_rows)
    out = program(*operands, 0.5)
    torch.testing.assert_close(out, eager_rounds(layout, *operands, 0.5), rtol=1e-10, atol=1e-10)


def test_layout_rejects_a_state_that_is_never_exported():
    batch = figure_batch()
    module = rounded_module(batch, 4)
    microbatch = module.microbatches[0]
    rounds = list(microbatch.rounds)
    late = rounds[-1]
    victim = next(s for s in late.sequences if s.state_from is not None)
    broken = attrs.evolve(victim, state_from=StateRef(round=victim.state_from.round, trajectory=victim.state_from.trajectory, position=victim.replay_start + 4),
                          replay_start=victim.replay_start + 4)
    rounds[-1] = attrs.evolve(late, sequences=tuple(broken if s is victim else s for s in late.sequences))
    bad = attrs.evolve(module, microbatches=(attrs.evolve(microbatch, rounds=tuple(rounds)),))
    # codegen's input is verified by the pass manager: the layout builder does not check rounds again
    with pytest.raises(IRVerificationError, match="microbatch 0, round"):
        run_pipeline(bad, [LayOut()], PassContext())


def test_layout_rejects_unrounded_modules_and_damaged_tensors():
    batch = figure_batch()
    module = rounded_module(batch, 4)
    with pytest.raises(IRVerificationError, match="rounded"):
        build_layout(attrs.evolve(module, phase=Phase.SEGMENTED), 0)
    with pytest.raises(IRVerificationError, match="no microbatch 7"):
        build_layout(module, 7)
    tensors = build_layout(module, 0).to_tensors()
    with pytest.raises(PlanArtifactError, match="ancestor_rows"):
        MicrobatchLayout.from_tensors({k: v for k, v in tensors.items() if k != "ancestor_rows.run_start"})
    shortened = tensors["seq_row_start.run_length"].copy()
    shortened[-1] -= 1
    if shortened[-1] == 0:
        damaged = {k: (v[:-1] if k.startswith("seq_row_start.") else v) for k, v in tensors.items()}
    else:
        damaged = dict(tensors, **{"seq_row_start.run_length": shortened})
    with pytest.raises(PlanArtifactError, match="seq_row_start"):
        MicrobatchLayout.from_tensors(damaged)


@given(st.lists(st.integers(-5, 40), max_size=60))
def test_arithmetic_runs_round_trip(values):
    from harts.codegen.layout import decode_arithmetic_runs, encode_arithmetic_runs

    array = np.asarray(values, dtype=np.int64)
    starts, steps, lengths = encode_arithmetic_runs(array)
    assert np.array_equal(decode_arithmetic_runs(starts, steps, lengths), array)
    assert len(starts) <= max(1, len(array))
    consecutive = np.arange(10_000, dtype=np.int64)
    assert len(encode_arithmetic_runs(np.concatenate([consecutive, consecutive]))[0]) == 2


# ------------------------------------------------------------------------------ programs


def random_operands(rows, heads=2, key_dim=3, value_dim=4, per_channel=True, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, key_dim, generator=generator, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(rows, heads, key_dim, generator=generator, dtype=dtype), dim=-1)
    v = torch.randn(rows, heads, value_dim, generator=generator, dtype=dtype)
    shape = (rows, heads, key_dim) if per_channel else (rows, heads)
    log_decay = -0.5 * torch.rand(shape, generator=generator, dtype=dtype)
    beta = torch.rand(rows, heads, generator=generator, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, log_decay, beta)]


def eager_rounds(layout: MicrobatchLayout, q, k, v, log_decay, beta, scale):
    """The rounds run directly: one kernel call per sequence, states handed over by dict."""
    out = q.new_zeros(layout.num_rows, q.shape[1], v.shape[2])
    states = {}
    for j in range(layout.num_sequences):
        rows = torch.as_tensor(np.concatenate([layout.replay_rows(j), layout.sequence_rows(j)]))
        source = int(layout.seq_state_source[j])
        initial = None if source < 0 else states[(source, int(layout.seq_replay_start[j]))][None]
        exports = [int(c) for c in layout.export_chunk[layout.export_offsets[j] : layout.export_offsets[j + 1]]]
        o, _, exported = naive.recurrent_linear_attention(
            q[rows], k[rows], v[rows], log_decay[rows], beta[rows], torch.tensor([0, len(rows)]),
            chunk_size=layout.chunk_size, scale=scale, initial_state=initial, export_chunks=[exports],
        )
        for slot, position in enumerate(layout.exports_of(j)):
            states[(j, int(position))] = exported[slot]
        own = layout.sequence_rows(j)
        out = out.index_copy(0, torch.as_tensor(own), o[len(rows) - len(own) :])
    return out


def expanded(layout: MicrobatchLayout, tensors):
    index = torch.tensor(layout.trajectory_rows)
    return [t[index] for t in tensors], BaselineView(list(np.diff(layout.trajectory_offsets)), layout.chunk_size)


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
@settings(max_examples=12, deadline=None)
@given(case=batches_with_groups(max_trajectories=6, max_length=24))
def test_linear_attention_program_equals_eager_rounds_and_expanded_baseline(case, per_channel):
    batch, chunk_size, groups = case
    module = rounded_module(batch, chunk_size, groups)
    for microbatch in module.microbatches:
        layout = build_layout(module, microbatch.index)
        operands = random_operands(layout.num_rows, per_channel=per_channel, seed=microbatch.index)
        program = build_linear_attention_program(layout)
        out = program(*operands, 0.7)
        direct = eager_rounds(layout, *operands, 0.7)
        torch.testing.assert_close(out, direct, rtol=1e-10, atol=1e-10)
        weight = torch.randn_like(out)
        grads = torch.autograd.grad((out * weight).sum(), operands, retain_graph=True)
        direct_grads = torch.autograd.grad((direct * weight).sum(), operands)
        for got, want in zip(grads, direct_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        # semantics: every trajectory expanded and run alone gives the same outputs, and a
        # loss over semantic positions gives the same gradients as its multiplicity-weighted compact form
        (eq, ek, ev, eg, eb), view = expanded(layout, operands)
        reference = view.linear_attention(eq, ek, ev, eg, eb, scale=0.7)
        index = torch.as_tensor(layout.trajectory_rows)
        torch.testing.assert_close(out[index], reference, rtol=1e-10, atol=1e-10)
        position_weight = torch.randn_like(reference)
        semantic_grads = torch.autograd.grad((reference * position_weight).sum(), operands)
        compact_weight = torch.zeros_like(out).index_add(0, index, position_weight)
        compact_grads = torch.autograd.grad((out * compact_weight).sum(), operands)
        for got, want in zip(compact_grads, semantic_grads):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_exported_state_gradients_pass_gradcheck():
    batch = figure_batch()
    layout = build_layout(rounded_module(batch, 4), 0)
    assert layout.num_exports and layout.num_rounds >= 2
    program = build_linear_attention_program(layout)
    operands = random_operands(layout.num_rows, heads=1, key_dim=2, value_dim=2)
    assert torch.autograd.gradcheck(lambda *xs: program(*xs, 0.9), tuple(operands), atol=1e-7, rtol=1e-6, fast_mode=True)


@settings(max_examples=12, deadline=None)
@given(case=batches_with_groups(max_trajectories=6, max_length=24), width=st.sampled_from([1, 2, 4, 6]))
def test_conv_and_attention_views_equal_expanded_baseline(case, width):
    batch, chunk_size, groups = case
    module = rounded_module(batch, chunk_size, groups)
    for microbatch in module.microbatches:
        layout = build_layout(module, microbatch.index)
        view = TreeView(layout)
        generator = torch.Generator().manual_seed(width)
        rows = layout.num_rows
        x = torch.randn(rows, 5, dtype=torch.float64, generator=generator, requires_grad=True)
        weight = torch.randn(5, width, dtype=torch.float64, generator=generator, requires_grad=True)
        bias = torch.randn(5, dtype=torch.float64, generator=generator)
        q = torch.randn(rows, 4, 6, dtype=torch.float64, generator=generator, requires_grad=True)
        k = torch.randn(rows, 2, 6, dtype=torch.float64, generator=generator, requires_grad=True)
        v = torch.randn(rows, 2, 3, dtype=torch.float64, generator=generator, requires_grad=True)
        (ex, eq, ek, ev), baseline = expanded(layout, (x, q, k, v))
        index = torch.as_tensor(layout.trajectory_rows)
        for compact, reference, inputs in (
            (view.causal_conv(x, weight, bias, "silu"), baseline.causal_conv(ex, weight, bias, "silu"), (x, weight)),
            (view.attention(q, k, v, scale=0.4), baseline.attention(eq, ek, ev, scale=0.4), (q, k, v)),
        ):
            torch.testing.assert_close(compact[index], reference, rtol=1e-10, atol=1e-12)
            position_weight = torch.randn(reference.shape, dtype=torch.float64, generator=generator)
            want = torch.autograd.grad((reference * position_weight).sum(), inputs)
            compact_weight = torch.zeros_like(compact).index_add(0, index, position_weight)
            got = torch.autograd.grad((compact * compact_weight).sum(), inputs)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def padding_kernels(seen_value_widths):
    """The references, plus ``attention_values`` that zero-pads values to the query head dim as the
    FlashAttention path does for MLA; ``seen_value_widths`` collects the value width attention gets."""

    def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal=True):
        seen_value_widths.append(v.shape[-1])
        return naive.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal)

    def attention_values(q, k, v):
        return torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1]))

    return types.SimpleNamespace(attention=attention, attention_values=attention_values)


@settings(max_examples=12, deadline=None)
@given(case=batches_with_groups(max_trajectories=6, max_length=24))
def test_attention_values_padded_before_the_gather_equal_the_unpadded_view(case):
    """A kernel set that pads narrower values gets them padded on the compact rows, before the key/value
    view's gather; the program keeps the value columns, so outputs and gradients (of q, k and the strided
    values of a fused projection's split) equal the expanded baseline's on the unpadded values."""
    batch, chunk_size, groups = case
    module = rounded_module(batch, chunk_size, groups)
    for microbatch in module.microbatches:
        layout = build_layout(module, microbatch.index)
        widths = []
        view = TreeView(layout, kernels=padding_kernels(widths))
        generator = torch.Generator().manual_seed(microbatch.index)
        q = torch.randn(layout.num_rows, 4, 6, dtype=torch.float64, generator=generator, requires_grad=True)
        k = torch.randn(layout.num_rows, 2, 6, dtype=torch.float64, generator=generator, requires_grad=True)
        fused = torch.randn(layout.num_rows, 2, 9, dtype=torch.float64, generator=generator, requires_grad=True)
        v = fused[..., 6:]  # [C, Hkv, 3], strided, as MLA's values split from kv_b_proj
        (eq, ek, ev), baseline = expanded(layout, (q, k, v))
        compact = view.attention(q, k, v, scale=0.4)
        reference = baseline.attention(eq, ek, ev, scale=0.4)
        index = torch.as_tensor(layout.trajectory_rows)
        assert compact.shape == (layout.num_rows, 4, 3)
        torch.testing.assert_close(compact[index], reference, rtol=1e-10, atol=1e-12)
        kv_rows, _ = attention_kv_rows(layout)
        reads_ancestors = contiguous_span(kv_rows) != (0, layout.num_rows)
        assert widths == ([6] if reads_ancestors else [3])
        position_weight = torch.randn(reference.shape, dtype=torch.float64, generator=generator)
        want = torch.autograd.grad((reference * position_weight).sum(), (q, k, fused))
        compact_weight = torch.zeros_like(compact).index_add(0, index, position_weight)
        got = torch.autograd.grad((compact * compact_weight).sum(), (q, k, fused))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def counting_kernels():
    calls = {"chunk_linear_attention": 0, "causal_conv1d": 0, "attention": 0}

    def wrap(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return getattr(naive, name)(*args, **kwargs)

        call.__name__ = name
        return call

    return types.SimpleNamespace(**{name: wrap(name) for name in calls}), calls


def test_tree_view_runs_the_generated_programs_one_call_per_round():
    batch = figure_batch()
    layout = build_layout(rounded_module(batch, 4), 0)
    kernels, calls = counting_kernels()
    view = TreeView(layout, kernels=kernels)
    assert view.chunk_size == layout.chunk_size == 4  # the plan's: a view takes no chunk size of its own
    q, k, v, g, beta = random_operands(layout.num_rows)
    view.linear_attention(q, k, v, g, beta, scale=1.0)
    assert calls["chunk_linear_attention"] == layout.num_rounds
    view.attention(q, k, q, scale=1.0)
    view.causal_conv(v.reshape(layout.num_rows, -1), torch.ones(8, 4, dtype=torch.float64), None, None)
    assert calls["attention"] == 1 and calls["causal_conv1d"] == 1
    program = view.program("linear_attention")
    assert isinstance(program, torch.fx.GraphModule)
    assert program.code.count("chunk_linear_attention(") == layout.num_rounds


def test_render_programs_is_readable_text():
    layout = build_layout(rounded_module(figure_batch(), 4), 0)
    text = render_programs(layout)
    for expected in ("def forward(self, q, k, v, log_decay, beta, scale)", "exported_round0", "initial_state",
                     "k_view", "context", "compact_log_probs", "microbatch 0"):
        assert expected in text


# ------------------------------------------------------------------ derived arrays, built from the trie runs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(0, 6)), max_size=12))
def test_concatenated_ranges_is_the_concatenation_of_aranges(ranges):
    from harts.ir.layout import concatenated_ranges

    starts, lengths = [s for s, _ in ranges], [n for _, n in ranges]
    expected = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in ranges] or [np.zeros(0, dtype=np.int64)])
    got = concatenated_ranges(np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64))
    assert got.dtype == np.int64 and got.tolist() == expected.tolist()


def test_concatenated_ranges_refuses_a_negative_length():
    from harts.ir.layout import concatenated_ranges

    with pytest.raises(ValueError):
        concatenated_ranges(np.array([0, 3]), np.array([2, -1]))


@settings(max_examples=40, deadline=None)
@given(batches_with_groups(max_trajectories=10))
def test_multiplicities_and_ancestor_rows_equal_their_definitions_over_the_map(case):
    """The builder derives q and the ancestor rows from the trie runs; by definition they are the map m's row
    counts and each sequence's trajectory rows before its start (the gathers it replaced)."""
    from harts.ir.layout import concatenated_ranges

    batch, chunk_size, groups = case
    module = rounded_module(batch, chunk_size, groups)
    for microbatch in module.microbatches:
        layout = build_layout(module, microbatch.index)
        assert layout.row_multiplicity.tolist() == np.bincount(layout.trajectory_rows, minlength=layout.num_rows).tolist()
        member_start = layout.trajectory_offsets[np.searchsorted(layout.trajectories, layout.seq_trajectory)]
        gathered = layout.trajectory_rows[concatenated_ranges(member_start, layout.seq_start)]
        assert layout.ancestor_rows.tolist() == gathered.tolist()
