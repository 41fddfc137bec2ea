"""Reference kernels: chunkwise gated delta rule against the token recurrence, conv and attention oracles."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.kernels.naive import attention, causal_conv1d, chunk_linear_attention, recurrent_linear_attention

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)


def _inputs(lengths, heads, key_dim, value_dim, per_channel, dtype=F64, seed=0, with_state=True):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=F64)

    q = randn(total, heads, key_dim)
    k = F.normalize(randn(total, heads, key_dim), dim=-1)
    v = randn(total, heads, value_dim)
    decay_shape = (total, heads, key_dim) if per_channel else (total, heads)
    # mix mild and strong forgetting so both ends of the decay range are exercised
    log_decay = -torch.rand(*decay_shape, generator=generator, dtype=F64) * torch.where(
        torch.rand(*decay_shape, generator=generator, dtype=F64) < 0.2, 8.0, 0.5
    )
    beta = torch.rand(total, heads, generator=generator, dtype=F64)
    state = randn(len(lengths), heads, key_dim, value_dim) if with_state else None
    tensors = [q, k, v, log_decay, beta] + ([state] if with_state else [])
    return [t.to(dtype) for t in tensors] + ([] if with_state else [None])


@st.composite
def varlen_cases(draw):
    chunk_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    near_boundary = st.sampled_from(
        sorted({max(0, c * chunk_size + d) for c in (1, 2, 3) for d in (-1, 0, 1)})
    )
    lengths = draw(st.lists(st.one_of(near_boundary, st.integers(0, 4 * chunk_size + 1)), min_size=1, max_size=5))
    num_chunks = [-(-n // chunk_size) for n in lengths]
    exports = [
        draw(st.lists(st.integers(1, c), max_size=3)) if c else [] for c in num_chunks
    ]
    per_channel = draw(st.booleans())
    return lengths, chunk_size, exports, per_channel


@settings(max_examples=60, deadline=None)
@given(case=varlen_cases(), seed=st.integers(0, 2**16))
def test_chunk_equals_recurrent_float64(case, seed):
    lengths, chunk_size, exports, per_channel = case
    q, k, v, g, beta, state = _inputs(lengths, 2, 4, 3, per_channel, seed=seed)
    cu = _cu(lengths)
    kwargs = dict(chunk_size=chunk_size, scale=0.5, initial_state=state, export_chunks=exports)
    o, final, exported = chunk_linear_attention(q, k, v, g, beta, cu, **kwargs)
    o_ref, final_ref, exported_ref = recurrent_linear_attention(q, k, v, g, beta, cu, **kwargs)
    assert o.shape == (sum(lengths), 2, 3)
    assert final.shape == (len(lengths), 2, 4, 3)
    assert exported.shape == (sum(map(len, exports)), 2, 4, 3)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(exported, exported_ref, rtol=1e-10, atol=1e-11)


def test_exported_states_are_the_states_after_c_chunks():
    lengths, chunk_size = [11, 8], 4
    q, k, v, g, beta, state = _inputs(lengths, 1, 3, 2, per_channel=True, seed=3)
    cu = _cu(lengths)
    _, final, exported = chunk_linear_attention(
        q, k, v, g, beta, cu, chunk_size=chunk_size, scale=1.0, initial_state=state, export_chunks=[[2, 3, 1], [2]]
    )
    for index, (sequence, tokens) in enumerate([(0, 8), (0, 11), (0, 4), (1, 8)]):
        start = int(cu[sequence])
        part = slice(start, start + tokens)
        _, prefix_final, _ = recurrent_linear_attention(
            q[part], k[part], v[part], g[part], beta[part], _cu([tokens]),
            chunk_size=chunk_size, scale=1.0, initial_state=state[sequence : sequence + 1],
        )
        torch.testing.assert_close(exported[index], prefix_final[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(exported[1], final[0], rtol=0, atol=0)  # partial last chunk: the final state
    torch.testing.assert_close(exported[3], final[1], rtol=0, atol=0)  # full last chunk: the final state


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_chunk_float32_within_relative_bound_of_float64_recurrence(per_channel):
    lengths, chunk_size = [37, 64, 5, 16], 16
    inputs64 = _inputs(lengths, 2, 16, 8, per_channel, seed=11)
    inputs32 = [t.float() for t in inputs64]
    cu = _cu(lengths)
    exports = [[1, 2], [4, 2], [], [1]]
    kwargs = dict(chunk_size=chunk_size, scale=16**-0.5, export_chunks=exports)
    o, final, exported = chunk_linear_attention(*inputs32[:5], cu, initial_state=inputs32[5], **kwargs)
    o_ref, final_ref, exported_ref = recurrent_linear_attention(*inputs64[:5], cu, initial_state=inputs64[5], **kwargs)
    assert o.dtype == final.dtype == exported.dtype == torch.float32
    for got, want in ((o, o_ref), (final, final_ref), (exported, exported_ref)):
        relative = (got.double() - want).norm() / want.norm()
        assert relative < 1e-5, relative


def _weighted_objective(o, final, exported, seed):
    generator = torch.Generator().manual_seed(seed)
    total = 0
    for tensor in (o, final, exported):
        total = total + (tensor * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)).sum()
    return total


@settings(max_examples=25, deadline=None)
@given(case=varlen_cases(), seed=st.integers(0, 2**16))
def test_chunk_gradients_equal_recurrent_gradients(case, seed):
    lengths, chunk_size, exports, per_channel = case
    leaves = [t.requires_grad_() for t in _inputs(lengths, 2, 3, 2, per_channel, seed=seed)]
    cu = _cu(lengths)
    kwargs = dict(chunk_size=chunk_size, scale=0.7, initial_state=leaves[5], export_chunks=exports)
    chunk_grads = torch.autograd.grad(
        _weighted_objective(*chunk_linear_attention(*leaves[:5], cu, **kwargs), seed), leaves, allow_unused=True
    )
    reference_grads = torch.autograd.grad(
        _weighted_objective(*recurrent_linear_attention(*leaves[:5], cu, **kwargs), seed), leaves, allow_unused=True
    )
    names = ["q", "k", "v", "log_decay", "beta", "initial_state"]
    for name, got, want in zip(names, chunk_grads, reference_grads):
        if want is None:  # nothing depends on it (e.g. all sequences empty)
            assert got is None or torch.count_nonzero(got) == 0, name
            continue
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_chunk_gradcheck_tiny(per_channel):
    lengths, chunk_size = [5, 3], 2
    leaves = [t.requires_grad_() for t in _inputs(lengths, 1, 2, 2, per_channel, seed=5)]
    cu = _cu(lengths)

    def run(q, k, v, g, beta, state):
        return chunk_linear_attention(
            q, k, v, g, beta, cu, chunk_size=chunk_size, scale=0.9, initial_state=state, export_chunks=[[1, 3], [1]]
        )

    assert torch.autograd.gradcheck(run, leaves, eps=1e-6, atol=1e-7, fast_mode=True)


def test_zero_state_and_empty_sequences():
    lengths = [0, 6, 0]
    q, k, v, g, beta, _ = _inputs(lengths, 1, 2, 2, per_channel=False, seed=1)
    o, final, exported = chunk_linear_attention(q, k, v, g, beta, _cu(lengths), chunk_size=4, scale=1.0)
    o_ref, final_ref, _ = recurrent_linear_attention(q, k, v, g, beta, _cu(lengths), chunk_size=4, scale=1.0)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(final, final_ref)
    assert torch.count_nonzero(final[0]) == 0 and torch.count_nonzero(final[2]) == 0
    assert exported.shape == (0, 1, 2, 2)


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
@pytest.mark.parametrize("split_chunks", [1, 2])
def test_split_at_chunk_boundary_with_state_handoff_equals_one_call(per_channel, split_chunks):
    chunk_size, length = 4, 13
    q, k, v, g, beta, state = _inputs([length], 2, 3, 2, per_channel, seed=7)
    kwargs = dict(chunk_size=chunk_size, scale=0.5)
    o_full, final_full, exported = chunk_linear_attention(
        q, k, v, g, beta, _cu([length]), initial_state=state, export_chunks=[[split_chunks]], **kwargs
    )
    cut = split_chunks * chunk_size
    head, tail = slice(0, cut), slice(cut, length)
    o_head, final_head, _ = chunk_linear_attention(
        q[head], k[head], v[head], g[head], beta[head], _cu([cut]), initial_state=state, **kwargs
    )
    o_tail, final_tail, _ = chunk_linear_attention(
        q[tail], k[tail], v[tail], g[tail], beta[tail], _cu([length - cut]), initial_state=final_head, **kwargs
    )
    torch.testing.assert_close(exported, final_head, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(torch.cat([o_head, o_tail]), o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final_tail, final_full, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    chunk_size=st.sampled_from([2, 3, 4]),
    fork_offset=st.sampled_from([-1, 0, 1]),
    fork_chunks=st.integers(1, 2),
    extra=st.integers(0, 5),
    per_channel=st.booleans(),
)
def test_branch_replay_from_exported_state_matches_independent_trajectories(
    chunk_size, fork_offset, fork_chunks, extra, per_channel
):
    """A side branch starts from the exported chunk state a(p), replays [a(p), p) and continues.

    Its outputs and the gradients of every shared input equal two independent trajectory calls.
    """
    fork = max(1, fork_chunks * chunk_size + fork_offset)
    boundary = (fork // chunk_size) * chunk_size
    main_length, branch_tail = fork + 5, 3 + extra
    main = [t.requires_grad_() for t in _inputs([main_length], 2, 3, 2, per_channel, seed=fork, with_state=False)[:5]]
    tail = [t.requires_grad_() for t in _inputs([branch_tail], 2, 3, 2, per_channel, seed=99, with_state=False)[:5]]
    kwargs = dict(chunk_size=chunk_size, scale=0.6)
    seed = 1234

    # HARTS-style: round 1 runs the main trajectory and exports the boundary state before the fork;
    # round 2 runs [replay(main[a(p):p]); branch tail] from that state.
    exports = [[boundary // chunk_size]] if boundary else [[]]
    o_main, _, exported = chunk_linear_attention(*main, _cu([main_length]), export_chunks=exports, **kwargs)
    replayed = [torch.cat([m[boundary:fork], t]) for m, t in zip(main, tail)]
    start_state = exported if boundary else None
    o_branch, _, _ = chunk_linear_attention(
        *replayed, _cu([fork - boundary + branch_tail]), initial_state=start_state, **kwargs
    )
    o_branch_new = o_branch[fork - boundary :]
    objective = _weighted_objective(o_main, o_branch_new, o_main.new_zeros(0), seed)
    grads = torch.autograd.grad(objective, main + tail)

    # Baseline: both root-to-leaf trajectories run independently from zero state.
    branch_full = [torch.cat([m[:fork], t]) for m, t in zip(main, tail)]
    o_main_ref, _, _ = recurrent_linear_attention(*main, _cu([main_length]), **kwargs)
    o_branch_ref, _, _ = recurrent_linear_attention(*branch_full, _cu([fork + branch_tail]), **kwargs)
    torch.testing.assert_close(o_main, o_main_ref, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(o_branch_new, o_branch_ref[fork:], rtol=1e-10, atol=1e-11)
    objective_ref = _weighted_objective(o_main_ref, o_branch_ref[fork:], o_main_ref.new_zeros(0), seed)
    grads_ref = torch.autograd.grad(objective_ref, main + tail)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_chunk_rejects_bad_inputs():
    q, k, v, g, beta, state = _inputs([5, 3], 1, 2, 2, per_channel=True)
    cu = _cu([5, 3])
    with pytest.raises(ValueError, match="export_chunks\\[1\\].*2"):
        chunk_linear_attention(q, k, v, g, beta, cu, chunk_size=2, scale=1.0, export_chunks=[[1], [3]])
    with pytest.raises(ValueError, match="cu_seqlens ends at 7"):
        chunk_linear_attention(q, k, v, g, beta, _cu([5, 2]), chunk_size=2, scale=1.0)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_linear_attention(q, k, v, g, beta, cu, chunk_size=2, scale=1.0, initial_state=state[:1])
    with pytest.raises(ValueError, match="log_decay"):
        chunk_linear_attention(q, k, v, g[:, :, :1], beta, cu, chunk_size=2, scale=1.0)


# --------------------------------------------------------------------------- causal conv


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    width=st.integers(1, 5),
    with_context=st.booleans(),
    with_bias=st.booleans(),
    activation=st.sampled_from(["silu", None]),
    seed=st.integers(0, 2**16),
)
def test_causal_conv_equals_direct_convolution_on_context_and_input(
    lengths, width, with_context, with_bias, activation, seed
):
    generator = torch.Generator().manual_seed(seed)
    channels = 3
    x = torch.randn(sum(lengths), channels, generator=generator, dtype=F64)
    weight = torch.randn(channels, width, generator=generator, dtype=F64)
    bias = torch.randn(channels, generator=generator, dtype=F64) if with_bias else None
    context = torch.randn(len(lengths), width - 1, channels, generator=generator, dtype=F64) if with_context else None
    y = causal_conv1d(x, weight, bias, _cu(lengths), context=context, activation=activation)
    assert y.shape == x.shape

    start = 0
    for index, length in enumerate(lengths):
        if length == 0:
            continue
        prefix = context[index] if with_context else x.new_zeros(width - 1, channels)
        sequence = torch.cat([prefix, x[start : start + length]])  # [W-1+L, D]
        direct = F.conv1d(sequence.T[None], weight[:, None, :], bias, groups=channels)[0].T  # valid conv: [L, D]
        if activation == "silu":
            direct = F.silu(direct)
        torch.testing.assert_close(y[start : start + length], direct, rtol=1e-12, atol=1e-12)
        start += length


def test_causal_conv_gradcheck():
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 4]
    x = torch.randn(7, 2, generator=generator, dtype=F64, requires_grad=True)
    weight = torch.randn(2, 3, generator=generator, dtype=F64, requires_grad=True)
    bias = torch.randn(2, generator=generator, dtype=F64, requires_grad=True)
    context = torch.randn(2, 2, 2, generator=generator, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b, c: causal_conv1d(x, w, b, _cu(lengths), context=c), (x, weight, bias, context)
    )


# --------------------------------------------------------------------------- attention


@settings(max_examples=25, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_attention_bottom_right_causal_equals_explicit_masked_softmax(spans, kv_heads, group, seed):
    generator = torch.Generator().manual_seed(seed)
    query_lengths = [ell for ell, _ in spans]
    key_lengths = [ell + h for ell, h in spans]
    heads, key_dim, value_dim = kv_heads * group, 4, 3
    q = torch.randn(sum(query_lengths), heads, key_dim, generator=generator, dtype=F64)
    k = torch.randn(sum(key_lengths), kv_heads, key_dim, generator=generator, dtype=F64)
    v = torch.randn(sum(key_lengths), kv_heads, value_dim, generator=generator, dtype=F64)
    o = attention(q, k, v, _cu(query_lengths), _cu(key_lengths), scale=0.3)
    assert o.shape == (sum(query_lengths), heads, value_dim)

    q_start = k_start = 0
    for ell, key_length in zip(query_lengths, key_lengths):
        ancestors = key_length - ell
        for j in range(ell):
            for head in range(heads):
                kv_head = head // group
                visible = ancestors + j + 1  # keys 0 .. h + j
                scores = k[k_start : k_start + visible, kv_head] @ q[q_start + j, head] * 0.3
                expected = torch.softmax(scores, 0) @ v[k_start : k_start + visible, kv_head]
                torch.testing.assert_close(o[q_start + j, head], expected, rtol=1e-12, atol=1e-12)
        q_start += ell
        k_start += key_length


def test_attention_equals_sdpa_on_full_sequences_and_bottom_right_slices():
    generator = torch.Generator().manual_seed(1)
    lengths = [7, 5]
    q = torch.randn(12, 4, 8, generator=generator, dtype=F64)
    k = torch.randn(12, 2, 8, generator=generator, dtype=F64)
    v = torch.randn(12, 2, 8, generator=generator, dtype=F64)
    o = attention(q, k, v, _cu(lengths), _cu(lengths), scale=8**-0.5)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        expected = F.scaled_dot_product_attention(
            q[part].transpose(0, 1),
            k[part].repeat_interleave(2, dim=1).transpose(0, 1),
            v[part].repeat_interleave(2, dim=1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        torch.testing.assert_close(o[part], expected, rtol=1e-12, atol=1e-12)
        # the last 3 queries against the whole key span give the same rows (bottom-right alignment)
        tail = slice(start + length - 3, start + length)
        o_tail = attention(q[tail], k[part], v[part], _cu([3]), _cu([length]), scale=8**-0.5)
        torch.testing.assert_close(o_tail, o[tail], rtol=1e-12, atol=1e-12)
        start += length


def test_attention_non_causal_and_errors():
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, generator=generator, dtype=F64)
    k = torch.randn(3, 1, 4, generator=generator, dtype=F64)
    v = torch.randn(3, 1, 2, generator=generator, dtype=F64)
    o = attention(q, k, v, _cu([2]), _cu([3]), scale=1.0, causal=False)
    expected = torch.softmax(q[:, 0] @ k[:, 0].T, dim=-1) @ v[:, 0]
    torch.testing.assert_close(o[:, 0], expected)
    with pytest.raises(ValueError, match="len_k >= len_q"):
        attention(k, q, q[:, :, :2], _cu([3]), _cu([2]), scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        attention(q.expand(2, 3, 4), k.expand(3, 2, 4), v.expand(3, 2, 2), _cu([2]), _cu([3]), scale=1.0)


def test_attention_gradcheck():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 2, generator=generator, dtype=F64, requires_grad=True)
    k = torch.randn(5, 1, 2, generator=generator, dtype=F64, requires_grad=True)
    v = torch.randn(5, 1, 2, generator=generator, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, _cu([1, 2]), _cu([2, 3]), scale=1 / math.sqrt(2)), (q, k, v)
    )
