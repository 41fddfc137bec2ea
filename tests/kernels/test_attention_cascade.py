"""Tree attention split at the forks (``kernels/attention/cascade.py``) held to the gathered key/value view.

The reference is one attention call per sequence over its gathered ancestor + own keys (the plain
``attention`` program), differentiated by autograd. The cascade's parts run on the reference kernels
here (float64), with its own backward (each part's gradient from the merged output and log-sum-exp);
the GPU test runs both programs on FlashAttention in bf16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.codegen.fx import attention_kv_rows, build_attention_program, build_cascade_attention_program
from harts.kernels import naive as naive_kernels
from harts.kernels.attention import naive
from harts.kernels.attention.cascade import CascadeAttention, prefix_split
from harts.kernels.rows.segment_sum import csr_by_row
from tests.helpers import batches_with_groups, make_plan
from tests.helpers.runtime import forked_batch

CUDA = torch.cuda.is_available()


def _layouts(batch, chunk, groups=None):
    plan = make_plan(batch, chunk, groups)
    return [plan.layout(m) for m in range(len(plan.module.microbatches))]


def _inputs(layout, heads=4, kv_heads=2, key_dim=12, value_dim=8, dtype=torch.float64, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = layout.num_rows
    q = torch.randn(rows, heads, key_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(rows, kv_heads, key_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, value_dim, generator=generator, dtype=torch.float64)
    weight = torch.randn(rows, heads, value_dim, generator=generator, dtype=torch.float64)
    return [t.to(device, dtype).requires_grad_() for t in (q, k, v)], weight.to(device)


def _run(program, inputs, weight, scale=0.3):
    o = program(*inputs, scale)
    grads = torch.autograd.grad((o.double() * weight).sum(), inputs)
    return o.detach(), grads


def _check_split(layout):
    """Every sequence's entries are disjoint runs that together are exactly its ancestor rows."""
    split = prefix_split(layout.seq_row_start, layout.ancestor_rows, layout.ancestor_offsets)
    seen = {s: [] for s in range(layout.num_sequences)}
    for e in range(len(split["query_bounds"]) - 1):
        keys = split["key_rows"][split["key_bounds"][e] : split["key_bounds"][e + 1]]
        assert keys.size and np.all(np.diff(keys) == 1)
        queries = split["query_rows"][split["query_bounds"][e] : split["query_bounds"][e + 1]]
        sequences = np.searchsorted(layout.seq_row_start, queries, side="right") - 1
        for s in np.unique(sequences).tolist():
            assert np.array_equal(queries[sequences == s], layout.sequence_rows(s))  # whole sequences
            seen[s].append(keys)
    for s, runs in seen.items():
        got = np.sort(np.concatenate(runs)) if runs else np.zeros(0, dtype=np.int64)
        assert np.array_equal(got, np.sort(layout.ancestor_rows_of(s)))
    return split


def _check_layout(layout, seed=0):
    split = _check_split(layout)
    gathered = build_attention_program(layout, naive_kernels)
    cascade = build_cascade_attention_program(layout, naive_kernels)
    has_entries = split["query_rows"].size > 0
    assert any(isinstance(m, CascadeAttention) for m in cascade.children()) == has_entries
    inputs, weight = _inputs(layout, seed=seed)
    want, want_grads = _run(gathered, inputs, weight)
    got, got_grads = _run(cascade, inputs, weight)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    return has_entries


@pytest.mark.parametrize("chunk", [2, 4, 8])
def test_forks_around_chunk_boundaries_match_the_gathered_view(chunk):
    entries = [_check_layout(layout, seed=i) for i, layout in enumerate(_layouts(forked_batch(chunk), chunk))]
    assert any(entries)


@settings(max_examples=25, deadline=None)
@given(case=batches_with_groups(max_trajectories=6, max_length=20), seed=st.integers(0, 2**16))
def test_random_trees_match_the_gathered_view(case, seed):
    batch, chunk_size, groups = case
    for i, layout in enumerate(_layouts(batch, chunk_size, groups)):
        _check_layout(layout, seed=seed + i)


def test_the_reference_backward_given_its_own_output_is_autograd():
    generator = torch.Generator().manual_seed(1)
    q_lengths, k_lengths = [3, 0, 5, 1, 17], [7, 2, 5, 9, 40]
    cu_q = torch.tensor([0, *np.cumsum(q_lengths)])
    cu_k = torch.tensor([0, *np.cumsum(k_lengths)])
    for causal in (True, False):
        q = torch.randn(sum(q_lengths), 4, 6, generator=generator, dtype=torch.float64, requires_grad=True)
        k = torch.randn(sum(k_lengths), 2, 6, generator=generator, dtype=torch.float64, requires_grad=True)
        v = torch.randn(sum(k_lengths), 2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
        o = naive.attention(q, k, v, cu_q, cu_k, scale=0.4, causal=causal)
        o_parts, lse, state = naive.attention_forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, scale=0.4, causal=causal)
        torch.testing.assert_close(o_parts, o.detach(), rtol=0, atol=0)
        d_o = torch.randn(o.shape, generator=generator, dtype=torch.float64)
        want = torch.autograd.grad((o * d_o).sum(), (q, k, v))
        got = naive.attention_backward(d_o, q.detach(), k.detach(), v.detach(), o_parts, lse, cu_q, cu_k, state,
                                       scale=0.4, causal=causal)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_merging_two_key_sets_is_attention_over_their_union():
    generator = torch.Generator().manual_seed(2)
    rows, heads, dim = 6, 3, 4
    q = torch.randn(rows, heads, dim, generator=generator, dtype=torch.float64)
    k = torch.randn(20, heads, dim, generator=generator, dtype=torch.float64)
    v = torch.randn(20, heads, dim, generator=generator, dtype=torch.float64)
    # each row's first key set, then for some rows one or two further sets (rows 1 and 4 none)
    first = [list(range(0, 3 + r)) for r in range(rows)]
    further = {0: [[10, 11], [15]], 2: [[12, 13, 14]], 3: [[16], [17, 18]], 5: [[19]]}
    own_cu = torch.tensor([0, *np.cumsum([len(f) for f in first])])

    def flat(index_lists):
        return torch.tensor([i for lst in index_lists for i in lst], dtype=torch.long)

    def attend(key_sets, query_rows):
        cu_q = torch.arange(len(key_sets) + 1)
        cu_k = torch.tensor([0, *np.cumsum([len(s) for s in key_sets])])
        keys = flat(key_sets)
        return naive.attention_forward(q[query_rows], k[keys], v[keys], cu_q, cu_k, scale=0.5, causal=False)[:2]

    o, lse = attend(first, torch.arange(rows))
    part_rows = [r for r in range(rows) for _ in further.get(r, [])]
    part_sets = [s for r in range(rows) for s in further.get(r, [])]
    o_parts, lse_parts = attend(part_sets, torch.tensor(part_rows))
    offsets, positions = (torch.as_tensor(a) for a in csr_by_row(np.asarray(part_rows), rows))
    merged, merged_lse = naive.merge_attention_parts(o, lse, o_parts, lse_parts, offsets, positions)
    union = [first[r] + [i for s in further.get(r, []) for i in s] for r in range(rows)]
    want, want_lse = attend(union, torch.arange(rows))
    torch.testing.assert_close(merged, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(merged_lse, want_lse, rtol=1e-12, atol=1e-13)
    assert own_cu[-1] == sum(len(f) for f in first)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_cascade_on_flash_attention_matches_the_gathered_view():
    from harts.kernels import dispatch

    batch = forked_batch(64)
    for layout in _layouts(batch, 64):
        gathered = build_attention_program(layout, dispatch).to("cuda")
        cascade = build_cascade_attention_program(layout, dispatch).to("cuda")
        # MLA's shapes: 192-wide queries and keys, 128-wide values
        inputs, weight = _inputs(layout, heads=4, kv_heads=4, key_dim=192, value_dim=128, dtype=torch.bfloat16,
                                 device="cuda")
        want, want_grads = _run(gathered, inputs, weight)
        got, got_grads = _run(cascade, inputs, weight)
        rows, _ = attention_kv_rows(layout)
        assert rows.size > layout.num_rows  # the layout shares prefixes
        for a, b in zip((got, *got_grads), (want, *want_grads)):
            error = float((a.double() - b.double()).norm() / b.double().norm())
            assert error < 1e-2, error
        # deterministic: the same bits on a second run
        again, again_grads = _run(cascade, inputs, weight)
        assert torch.equal(again, got) and all(torch.equal(a, b) for a, b in zip(again_grads, got_grads))


def test_the_merge_kernel_matches_the_reference_under_the_interpreter():
    from tests.helpers.interpreter import run_under_interpreter

    results = run_under_interpreter(Path(__file__).with_name("_cascade_cases.py"), timeout=900)
    assert results["examples"] >= 30 and results["rows_without_parts"] > 0
    # fp32 online merge against the float64 reference
    assert results["merge_error"] < 1e-5 and results["lse_error"] < 1e-5, results
    # the whole program with both kernels, in float32, against the gathered view
    assert results["program_error"] < 1e-5, results
