"""Opt-in batch invariance of the fast chunkwise kernel (``HARTS_BATCH_INVARIANT_CHUNKS``).

The batched torch steps of :mod:`harts.kernels.chunk_fast` run on fixed-shape pieces of
chunks when the variable is set, so a chunk's intra-chunk terms and outputs do not depend on
what else shares the call. CPU cases check the pieces against the one-batch computation
(values and gradients) and the bitwise invariance of a chunk's terms to its neighbours; the
GPU case checks whole packed calls against the same sequences alone.
"""

from __future__ import annotations

import pytest
import torch

from harts.kernels import chunk_fast
from harts.kernels.state_scan import TRITON_AVAILABLE

HAS_CUDA = torch.cuda.is_available()


def chunked_inputs(num_chunks: int, *, per_channel: bool, seed: int = 0, chunk: int = 16, heads: int = 2,
                   key_dim: int = 8, value_dim: int = 8, dtype=torch.float64, device="cpu"):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = torch.nn.functional.normalize(rand(num_chunks, heads, chunk, key_dim), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(rand(num_chunks, heads, chunk, key_dim), dim=-1)
    v = rand(num_chunks, heads, chunk, value_dim)
    decay_shape = (num_chunks, heads, chunk, key_dim) if per_channel else (num_chunks, heads, chunk)
    log_decay = -torch.rand(*decay_shape, generator=generator, dtype=torch.float64) * 0.5
    beta = torch.rand(num_chunks, heads, chunk, generator=generator, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, log_decay, beta)]


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
@pytest.mark.parametrize("num_chunks,piece", [(7, 3), (6, 3), (2, 5), (1, 1)])
def test_fixed_pieces_equal_one_batch_values_and_gradients(per_channel, num_chunks, piece):
    inputs = chunked_inputs(num_chunks, per_channel=per_channel)
    whole = chunk_fast._intra_chunk_terms(*inputs)
    pieces = chunk_fast._in_fixed_pieces(chunk_fast._intra_chunk_terms, inputs, piece)
    assert whole.keys() == pieces.keys()
    for key in whole:
        assert pieces[key].shape == whole[key].shape
        torch.testing.assert_close(pieces[key], whole[key], rtol=1e-12, atol=1e-12)
    weights = {key: torch.randn_like(value) for key, value in whole.items()}
    grads_whole = torch.autograd.grad(sum((whole[k] * w).sum() for k, w in weights.items()), inputs)
    grads_pieces = torch.autograd.grad(sum((pieces[k] * w).sum() for k, w in weights.items()), inputs)
    for a, b in zip(grads_pieces, grads_whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_a_chunk_in_fixed_pieces_does_not_depend_on_its_neighbours(per_channel):
    inputs = chunked_inputs(9, per_channel=per_channel, dtype=torch.float32)
    piece = 4
    packed = chunk_fast._in_fixed_pieces(chunk_fast._intra_chunk_terms, inputs, piece)
    # chunks 5..6 alone (another position in their piece, zero padding instead of neighbours)
    alone = chunk_fast._in_fixed_pieces(chunk_fast._intra_chunk_terms, [t[5:7] for t in inputs], piece)
    for key in packed:
        assert torch.equal(packed[key][5:7], alone[key]), key


def test_piece_setting_is_validated(monkeypatch):
    monkeypatch.delenv(chunk_fast.BATCH_INVARIANT_ENV, raising=False)
    assert chunk_fast.invariant_piece_chunks() == 0
    monkeypatch.setenv(chunk_fast.BATCH_INVARIANT_ENV, "32")
    assert chunk_fast.invariant_piece_chunks() == 32
    for bad in ("-1", "x"):
        monkeypatch.setenv(chunk_fast.BATCH_INVARIANT_ENV, bad)
        with pytest.raises(ValueError, match="HARTS_BATCH_INVARIANT_CHUNKS must be a non-negative integer"):
            chunk_fast.invariant_piece_chunks()


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and TRITON_AVAILABLE), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_packed_call_is_bitwise_the_sequence_alone_on_gpu(monkeypatch, dtype, per_channel):
    monkeypatch.setenv(chunk_fast.BATCH_INVARIANT_ENV, "32")
    generator = torch.Generator().manual_seed(3)
    heads, key_dim, value_dim, chunk = 4, 128, 128, 64
    lengths = [5000, 700, 2113, 64, 3001]
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).cuda()

    q = torch.nn.functional.normalize(rand(total, heads, key_dim), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rand(total, heads, key_dim), dim=-1).to(dtype)
    v = rand(total, heads, value_dim).to(dtype)
    decay_shape = (total, heads, key_dim) if per_channel else (total, heads)
    log_decay = -torch.rand(*decay_shape, generator=generator).cuda() * 0.2
    beta = torch.rand(total, heads, generator=generator).cuda().to(dtype)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed, final, _ = chunk_fast.chunk_linear_attention(q, k, v, log_decay, beta, bounds, chunk_size=chunk,
                                                         scale=key_dim**-0.5)
    for index, length in enumerate(lengths):
        start, stop = int(bounds[index]), int(bounds[index + 1])
        one = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        alone, alone_final, _ = chunk_fast.chunk_linear_attention(
            q[start:stop], k[start:stop], v[start:stop], log_decay[start:stop], beta[start:stop], one,
            chunk_size=chunk, scale=key_dim**-0.5)
        assert torch.equal(packed[start:stop], alone), f"sequence {index}"
        assert torch.equal(final[index : index + 1], alone_final), f"sequence {index}"
