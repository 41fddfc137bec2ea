"""The fla-based chunkwise gated delta rule (HARTS' contract, Eq. 16) held to the pure-torch reference.

GPU only (fla's kernels need CUDA): varlen batches with odd lengths, initial states, exported
states and their gradients, forks at B-1 / B / B+1 whose side branch resumes from an exported
state and replays, KDA and Gated DeltaNet gates, bf16 and fp32; plus bit-for-bit agreement
with stock ``fla.ops.kda.chunk_kda`` on calls without exports, and batch invariance of the
forward pass (a sequence packed with others gives the outputs it gives alone).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from harts.kernels.linear_attention import chunk, naive

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
CHUNK = 64
HEADS, KEY_DIM, VALUE_DIM = 4, 128, 128
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}  # fp32 operands run as tf32 in fla's dots


@pytest.fixture(scope="module", autouse=True)
def fla_installed():
    if not chunk.fla_available():
        pytest.skip("flash-linear-attention is not installed")


def test_the_call_layouts_chunk_indices_are_flas():
    """The call layout builds fla's chunk table on the host (fla's own reads cu_seqlens back from the GPU)."""
    from fla.ops.utils import prepare_chunk_indices

    bounds = np.array([0, 5, 5, 70, 200, 264, 265])  # an empty sequence, exact multiples and remainders
    layout = chunk._CallLayout(bounds, CHUNK, [], torch.device(DEVICE))
    assert torch.equal(layout.chunk_indices, prepare_chunk_indices(layout.cu_seqlens, CHUNK))
    assert layout.chunk_indices.device.type == "cuda" and layout.cu_seqlens.tolist() == bounds.tolist()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach()).norm() / want.detach().norm().clamp_min(1e-30))


def random_inputs(total: int, gate: str, dtype: torch.dtype, seed: int, sequences: int):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=DEVICE)

    q = torch.nn.functional.normalize(randn(total, HEADS, KEY_DIM), dim=-1)
    k = torch.nn.functional.normalize(randn(total, HEADS, KEY_DIM), dim=-1)
    v = randn(total, HEADS, VALUE_DIM)
    shape = (total, HEADS, KEY_DIM) if gate == "kda" else (total, HEADS)
    log_decay = -torch.rand(shape, generator=generator, device=DEVICE) * 0.3
    beta = torch.rand(total, HEADS, generator=generator, device=DEVICE)
    initial = randn(sequences, HEADS, KEY_DIM, VALUE_DIM) * 0.1
    low = [t.to(dtype) for t in (q, k, v)] + [log_decay, beta.to(dtype), initial]
    return [t.detach().requires_grad_() for t in low]


def reference_copies(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_varlen_call_with_initial_and_exported_states_matches_the_reference(gate, dtype):
    lengths = [63, 64, 65, 1, 300, 129]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.as_tensor(bounds, device=DEVICE)
    exports = [[1], [1], [1, 2], [1], [1, 3, 5], [2, 3]]  # chunk boundaries and final states
    inputs = random_inputs(int(bounds[-1]), gate, dtype, seed=1, sequences=len(lengths))
    reference = reference_copies(inputs)
    o, final, exported = chunk.chunk_linear_attention(*inputs[:5], cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5,
                                                      initial_state=inputs[5], export_chunks=exports)
    want = naive.chunk_linear_attention(*reference[:5], cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5,
                                        initial_state=reference[5], export_chunks=exports)
    assert o.dtype == dtype and final.dtype == torch.float32 and exported.dtype == torch.float32
    tolerance = TOLERANCE[dtype]
    for name, got, expected in zip(("o", "final", "exported"), (o, final, exported), want):
        assert relative_error(got, expected) < tolerance, name
    weights = [torch.randn_like(t) for t in want]
    got_grads = torch.autograd.grad(sum((g.double() * w).sum() for g, w in zip((o, final, exported), weights)), inputs)
    want_grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(want, weights)), reference)
    for name, got, expected in zip(("q", "k", "v", "log_decay", "beta", "initial_state"), got_grads, want_grads):
        assert got is not None, name
        assert relative_error(got, expected) < 2 * tolerance, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("fork", [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_a_side_branch_resumed_from_an_exported_state_equals_the_whole_trajectory(gate, dtype, fork):
    """Round 1 runs the trunk and exports the state at the fork's anchor; round 2 replays
    [anchor, fork) from that state and runs the branch. Outputs and every input gradient (through
    the exported state) match the branch's trajectory computed whole by the reference."""
    trunk_length, branch_length = fork + 90, 77
    anchor_chunks = fork // CHUNK
    total = trunk_length + branch_length
    inputs = random_inputs(total, gate, dtype, seed=fork, sequences=1)
    q, k, v, log_decay, beta, initial = inputs
    trunk = [t[:trunk_length] for t in (q, k, v, log_decay, beta)]
    # the branch row r of trajectory 2 is trunk row r below the fork, its own row after
    branch_rows = torch.cat([torch.arange(fork, device=DEVICE), torch.arange(trunk_length, total, device=DEVICE)])
    cu1 = torch.tensor([0, trunk_length], device=DEVICE)
    o1, _, exported = chunk.chunk_linear_attention(
        *trunk, cu1, chunk_size=CHUNK, scale=KEY_DIM**-0.5, initial_state=initial,
        export_chunks=[[anchor_chunks]] if anchor_chunks else None,
    )
    start_state = exported if anchor_chunks else initial
    replay = branch_rows[anchor_chunks * CHUNK :]
    cu2 = torch.tensor([0, replay.numel()], device=DEVICE)
    o2, final2, _ = chunk.chunk_linear_attention(
        *(t.index_select(0, replay) for t in (q, k, v, log_decay, beta)), cu2,
        chunk_size=CHUNK, scale=KEY_DIM**-0.5, initial_state=start_state,
    )
    branch_out = o2[fork - anchor_chunks * CHUNK :]

    reference = reference_copies(inputs)
    rq, rk, rv, rg, rb, r0 = reference
    whole = [t.index_select(0, branch_rows) for t in (rq, rk, rv, rg, rb)]
    cu = torch.tensor([0, branch_rows.numel()], device=DEVICE)
    want_o, want_final, _ = naive.chunk_linear_attention(*whole, cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5,
                                                         initial_state=r0)
    tolerance = TOLERANCE[dtype]
    assert relative_error(branch_out, want_o[fork:]) < tolerance
    assert relative_error(final2, want_final) < tolerance
    weight_o, weight_final = torch.randn_like(want_o[fork:]), torch.randn_like(want_final)
    trunk_weight = torch.randn(o1.shape, device=DEVICE, dtype=torch.float64)
    got = torch.autograd.grad(
        (branch_out.double() * weight_o).sum() + (final2.double() * weight_final).sum()
        + (o1.double() * trunk_weight).sum(), inputs,
    )
    want_trunk, _, _ = naive.chunk_linear_attention(*(t[:trunk_length] for t in (rq, rk, rv, rg, rb)),
                                                    cu1, chunk_size=CHUNK, scale=KEY_DIM**-0.5, initial_state=r0)
    want = torch.autograd.grad(
        (want_o[fork:] * weight_o).sum() + (want_final * weight_final).sum() + (want_trunk * trunk_weight).sum(),
        reference,
    )
    for name, a, b in zip(("q", "k", "v", "log_decay", "beta", "initial_state"), got, want):
        assert relative_error(a, b) < 2 * tolerance, name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_without_exports_the_forward_is_stock_fla_bit_for_bit(gate):
    """Outputs and final states equal stock ``chunk_kda``'s exactly (the same kernels in the same order);
    gradients agree to rounding (the reverse scans reduce over K in a different order)."""
    lengths = [500, 64, 1000, 33]
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device=DEVICE)
    inputs = random_inputs(sum(lengths), gate, torch.bfloat16, seed=7, sequences=len(lengths))
    ours = chunk.chunk_linear_attention(*inputs[:5], cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5, initial_state=inputs[5])
    stock = chunk.stock_chunk_kda(*inputs[:5], cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5, initial_state=inputs[5])
    assert torch.equal(ours[0], stock[0]) and torch.equal(ours[1], stock[1])
    weight = torch.randn_like(ours[0])
    got = torch.autograd.grad((ours[0] * weight).sum() + ours[1].sum(), inputs)
    want = torch.autograd.grad((stock[0] * weight).sum() + stock[1].sum(), inputs)
    for name, a, b in zip(("q", "k", "v", "log_decay", "beta", "initial_state"), got, want):
        assert relative_error(a, b) < 2 * TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_the_forward_pass_is_batch_invariant(gate):
    lengths = [1000, 2000, 1500, 700]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.as_tensor(bounds, device=DEVICE)
    inputs = random_inputs(int(bounds[-1]), gate, torch.bfloat16, seed=3, sequences=len(lengths))
    with torch.no_grad():
        packed, finals, _ = chunk.chunk_linear_attention(*inputs[:5], cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5,
                                                         initial_state=inputs[5])
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            alone, final, _ = chunk.chunk_linear_attention(
                *(t[lo:hi] for t in inputs[:5]), torch.tensor([0, hi - lo], device=DEVICE),
                chunk_size=CHUNK, scale=KEY_DIM**-0.5, initial_state=inputs[5][i : i + 1],
            )
            assert torch.equal(packed[lo:hi], alone), i
            assert torch.equal(finals[i : i + 1], final), i


def _call_under_checkpoint(inputs, cu, exports, keep: bool):
    def body(*tensors):
        with chunk.keep_backward_intermediates() if keep else contextlib.nullcontext():
            return chunk.chunk_linear_attention(*tensors[:5], cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5,
                                                initial_state=tensors[5], export_chunks=exports)

    return checkpoint(body, *inputs, use_reentrant=False)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_kept_intermediates_give_the_recomputed_gradients_bit_for_bit(gate):
    """Under activation checkpointing, a call that keeps w, u, q·g, k·g, h and v_new from its recompute
    returns the outputs and gradients of the call that recomputes them in its backward, exactly."""
    lengths = [63, 64, 65, 300, 129]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.as_tensor(bounds, device=DEVICE)
    exports = [[1], [1], [1, 2], [1, 3, 5], [2, 3]]
    inputs = random_inputs(int(bounds[-1]), gate, torch.bfloat16, seed=11, sequences=len(lengths))
    results = {}
    # the switch spans the backward too: the checkpoint's recompute runs there, and it is what keeps the tensors
    with chunk.intermediates_kept_in_recompute(True):
        for keep in (False, True):
            outputs = _call_under_checkpoint(inputs, cu, exports, keep)
            weights = [torch.randn(t.shape, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(i))
                       for i, t in enumerate(outputs)]
            grads = torch.autograd.grad(sum((o.float() * w).sum() for o, w in zip(outputs, weights)), inputs)
            results[keep] = ([o.detach() for o in outputs], grads)
    for name, a, b in zip(("o", "final", "exported"), results[False][0], results[True][0]):
        assert torch.equal(a, b), name
    for name, a, b in zip(("q", "k", "v", "log_decay", "beta", "initial_state"), results[False][1], results[True][1]):
        assert torch.equal(a, b), name


def test_the_context_decides_what_the_forward_saves():
    """Outside ``keep_backward_intermediates`` a call saves what fla's default saves; inside it, six more
    tensors (w, u, q·g, k·g, h, v_new); with the switch off it ignores the context."""
    lengths = [100, 200]
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device=DEVICE)
    inputs = random_inputs(sum(lengths), "kda", torch.bfloat16, seed=5, sequences=len(lengths))

    def saved_count() -> int:
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            chunk.chunk_linear_attention(*inputs[:5], cu, chunk_size=CHUNK, scale=KEY_DIM**-0.5, initial_state=inputs[5])
        return len(packed)

    plain = saved_count()
    with chunk.keep_backward_intermediates():
        with chunk.intermediates_kept_in_recompute(True):
            kept = saved_count()
        with chunk.intermediates_kept_in_recompute(False):
            switched_off = saved_count()
    assert kept == plain + 6 and switched_off == plain
