"""Grouped-GEMM experts held to the per-expert reference; the model's experts go through the dispatch."""

from __future__ import annotations

import pytest
import torch

from harts.kernels.moe import grouped, naive

CUDA = torch.cuda.is_available()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def moe_errors(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    experts, hidden, intermediate, rows, top_k = 6, 32, 16, 29, 2
    gate_up = (torch.randn(experts, 2 * intermediate, hidden) * 0.5).to(device, dtype).requires_grad_()
    down = (torch.randn(experts, hidden, intermediate) * 0.5).to(device, dtype).requires_grad_()
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    indices = torch.stack([torch.randperm(5, device=device)[:top_k] for _ in range(rows)])  # expert 5 never hit
    weights = torch.rand(rows, top_k, device=device, dtype=dtype, requires_grad=True)
    want = naive.moe_experts(x, indices, weights, gate_up, down)
    got = grouped.moe_experts(x, indices, weights, gate_up, down)
    params = (x, weights, gate_up, down)
    grads = torch.autograd.grad(got.float().square().sum(), params)
    ref_grads = torch.autograd.grad(want.float().square().sum(), params)
    return {"y": rel(got, want), **{f"d{i}": rel(a, b) for i, (a, b) in enumerate(zip(grads, ref_grads))}}


def test_grouped_experts_match_the_reference():
    errors = moe_errors()
    assert max(errors.values()) < 1e-6, errors


def test_the_model_experts_run_the_dispatched_kernel(monkeypatch):
    from harts.kernels import dispatch
    from harts.runtime import BaselineView, HybridConfig, HybridModel

    torch.manual_seed(1)
    model = HybridModel(HybridConfig.preset("tiny", num_layers=2, layer_types=["linear", "full"], ffn="moe",
                                            first_k_dense_replace=0))
    ids = torch.randint(0, model.config.vocab_size, (23,))
    view = BaselineView([10, 13], model.config.chunk_size)
    calls = []

    def grouped_everywhere(x, indices, weights, gate_up_proj, down_proj):
        calls.append(x.shape[0])
        return grouped.moe_experts(x, indices, weights, gate_up_proj, down_proj)

    before, _ = model.forward_hidden(ids, view)
    monkeypatch.setattr(dispatch, "moe_experts", grouped_everywhere)
    after, _ = model.forward_hidden(ids, view)
    assert calls == [23, 23]
    assert rel(after, before) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_experts(dtype):
    errors = moe_errors(device="cuda", dtype=dtype)
    assert max(errors.values()) < (2e-2 if dtype == torch.bfloat16 else 1e-5), errors
