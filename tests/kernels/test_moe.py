"""Grouped-GEMM experts held to the per-expert reference; the model's experts go through the dispatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harts.kernels.moe import grouped, naive
from tests.helpers.interpreter import run_under_interpreter

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
    # experts 2 (between others) and 5 (the last) are never hit: empty segments in the middle and at the end
    allowed = torch.tensor([0, 1, 3, 4], device=device)
    indices = torch.stack([allowed[torch.randperm(4, device=device)[:top_k]] for _ in range(rows)])
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


def test_the_row_sum_backward_matches_the_reference_under_the_interpreter():
    # each row's gradient summed from its k expert-sorted reads by the Triton row-sum kernel, and the
    # return to (row, slot) order by the inverse permutation, against the per-expert reference's autograd
    results = run_under_interpreter(Path(__file__).with_name("_moe_cases.py"), timeout=900)
    assert results["examples"] >= 20 and results["kernel_path"] == results["examples"], results
    assert max(results[key] for key in ("y", "dx", "dweights", "dgate_up", "ddown")) < 1e-5, results


def test_the_model_experts_run_the_dispatched_kernel(monkeypatch):
    from harts.kernels import dispatch
    from harts.runtime import BaselineView, HybridConfig, HybridModel

    torch.manual_seed(1)
    model = HybridModel(HybridConfig.preset("tiny", num_layers=2, layer_types=["linear", "full"], ffn="moe",
                                            first_k_dense_replace=0))
    ids = torch.randint(0, model.config.vocab_size, (23,))
    view = BaselineView([10, 13], 16)
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


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_grouped_experts_never_wait_for_the_device():
    torch.manual_seed(0)
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(8, 64, 64, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(8, 64, 32, device="cuda", dtype=torch.bfloat16)
    indices = torch.randint(0, 8, (300, 2), device="cuda")
    weights = torch.rand(300, 2, device="cuda")
    if not grouped.grouped_mm_available(x):
        pytest.skip("torch._grouped_mm needs a Hopper or newer GPU")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped.moe_experts(x, indices, weights, gate_up, down)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = naive.moe_experts(x.float(), indices, weights, gate_up.float(), down.float())
    assert rel(got, want) < 2e-2
