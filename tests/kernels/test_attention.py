"""The fast attention paths held to the pure-torch reference (packed spans, bottom-right causal, GQA, Dk != Dv)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.kernels.attention import naive, tree_mask, varlen

CUDA = torch.cuda.is_available()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def attention_errors(device="cpu", dtype=torch.float32, causal=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q_lengths, k_lengths = [3, 0, 5, 1, 17], [7, 2, 5, 9, 40]
    heads_q, heads_kv, key_dim, value_dim = 4, 2, 24, 16  # GQA and Dk != Dv (MLA-like)
    cu_q = torch.tensor([0] + np.cumsum(q_lengths).tolist(), device=device)
    cu_k = torch.tensor([0] + np.cumsum(k_lengths).tolist(), device=device)
    q = torch.randn(sum(q_lengths), heads_q, key_dim, generator=generator).to(device, dtype).requires_grad_()
    k = torch.randn(sum(k_lengths), heads_kv, key_dim, generator=generator).to(device, dtype).requires_grad_()
    v = torch.randn(sum(k_lengths), heads_kv, value_dim, generator=generator).to(device, dtype).requires_grad_()
    got = varlen.attention(q, k, v, cu_q, cu_k, scale=0.2, causal=causal)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = naive.attention(*refs, cu_q, cu_k, scale=0.2, causal=causal)
    weight = torch.randn(got.shape, generator=generator).to(device, torch.float64)
    grads = torch.autograd.grad((got.double() * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * weight).sum(), refs)
    errors = {"o": rel(got, want), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}
    return errors, got.dtype


@pytest.mark.parametrize("causal", [True, False])
def test_per_sequence_path_matches_the_reference(causal):
    errors, dtype = attention_errors(causal=causal)
    assert dtype == torch.float32
    assert max(errors.values()) < 1e-5, errors


def test_short_key_spans_are_rejected():
    q, k = torch.zeros(3, 1, 8), torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="len_k >= len_q"):
        varlen.attention(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 2]), scale=1.0)


def tree_attention_errors(device="cpu", dtype=torch.float32, rows=300, seed=0):
    """A random forest of rows (shuffled ids): tree attention vs each row against its gathered ancestor chain."""
    rng = np.random.default_rng(seed)
    chain_parent = np.array([-1] + [int(rng.integers(-1, i)) if rng.random() < 0.3 else i - 1 for i in range(1, rows)])
    permutation = rng.permutation(rows)
    inverse = np.argsort(permutation)
    parent = np.where(chain_parent[permutation] >= 0, inverse[np.maximum(chain_parent[permutation], 0)], -1)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 4, 24, generator=generator).to(device, dtype).requires_grad_()
    k = torch.randn(rows, 2, 24, generator=generator).to(device, dtype).requires_grad_()
    v = torch.randn(rows, 2, 16, generator=generator).to(device, dtype).requires_grad_()
    got = tree_mask.tree_attention(q, k, v, parent, scale=0.3)
    chains = []
    for row in range(rows):
        chain, node = [], row
        while node >= 0:
            chain.append(node)
            node = parent[node]
        chains.append(chain[::-1])
    gather = torch.as_tensor(np.concatenate(chains), device=device)
    cu_k = torch.tensor([0] + np.cumsum([len(c) for c in chains]).tolist(), device=device)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = naive.attention(refs[0], refs[1][gather], refs[2][gather], torch.arange(rows + 1, device=device), cu_k,
                           scale=0.3)
    weight = torch.randn(got.shape, generator=generator).to(device, torch.float64)
    grads = torch.autograd.grad((got.double() * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * weight).sum(), refs)
    return {"o": rel(got, want), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}


def test_tree_mask_matches_gathered_ancestor_views():
    errors = tree_attention_errors()
    assert max(errors.values()) < 1e-5, errors


def test_layout_parents_chain_every_trajectory_to_its_root():
    import harts
    from harts.rollouts.workloads import swe_like_step

    batch = swe_like_step(seed=3, scale=0.004, vocab_size=256)
    plan = harts.compile(batch, capacity=65536, chunk_size=16)
    layout = plan.layout(0)
    parent = tree_mask.layout_parents(layout)
    for member in range(len(layout.trajectories)):
        rows = layout.trajectory_rows[layout.trajectory_offsets[member] : layout.trajectory_offsets[member + 1]]
        assert parent[rows[0]] == -1
        assert np.array_equal(parent[rows[1:]], rows[:-1])
    order, leave = tree_mask.preorder(parent)
    assert sorted(order.tolist()) == list(range(layout.num_rows))
    assert np.all(leave > np.arange(layout.num_rows))


def test_flash_values_pad_to_the_head_dim_flash_computes_with():
    q = torch.zeros(3, 2, 20)
    v = torch.randn(3, 2, 13)
    padded = varlen.flash_values(q, v)
    assert padded.shape == (3, 2, 24)  # the wider of 20 and 13, rounded up to 8
    assert torch.equal(padded[..., :13], v) and not padded[..., 13:].any()
    wide = torch.randn(3, 2, 24)
    assert varlen.flash_values(q, wide) is wide


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-flash", "fp32-sdpa"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_attention(dtype, causal):
    errors, out_dtype = attention_errors(device="cuda", dtype=dtype, causal=causal)
    assert out_dtype == dtype
    assert max(errors.values()) < (2e-2 if dtype == torch.bfloat16 else 1e-4), errors


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tree_mask_flex(dtype):
    errors = tree_attention_errors(device="cuda", dtype=dtype, rows=700)
    assert max(errors.values()) < (2e-2 if dtype == torch.bfloat16 else 1e-4), errors


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_attention_program_pads_mla_values_before_the_view_bitwise():
    """MLA's narrower values, strided from their fused projection, padded on the compact rows before the
    key/value view's gather (``Dispatch.attention_values``): the output equals, bit for bit, the program
    that lets FlashAttention pad every gathered view row, and the gradients agree within bf16 rounding."""
    import types

    import harts
    from harts.codegen.fx import build_attention_program
    from harts.kernels import dispatch
    from harts.rollouts.workloads import swe_like_step

    batch = swe_like_step(seed=3, scale=0.004, vocab_size=256)
    layout = harts.compile(batch, capacity=65536, chunk_size=16).layout(0)
    padded = build_attention_program(layout, dispatch).to("cuda")
    unpadded = build_attention_program(layout, types.SimpleNamespace(attention=dispatch.attention)).to("cuda")
    assert any(node.name == "kernel_values" for node in padded.graph.nodes)
    generator = torch.Generator().manual_seed(0)
    rows, heads = layout.num_rows, 4
    q = torch.randn(rows, heads, 24, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    k = torch.randn(rows, heads, 24, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    fused = torch.randn(rows, heads, 40, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    weight = torch.randn(rows, heads, 16, generator=generator).to("cuda", torch.float32)
    outputs, grads = [], []
    for program in (padded, unpadded):
        o = program(q, k, fused[..., 24:], 0.3)  # [C, H, 16]
        outputs.append(o)
        grads.append(torch.autograd.grad((o.float() * weight).sum(), (q, k, fused)))
    assert outputs[0].shape == (rows, heads, 16)
    assert torch.equal(outputs[0], outputs[1])
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-2
