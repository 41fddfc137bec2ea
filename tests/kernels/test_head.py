"""The log-prob head's row-statistics kernels (``kernels/head/softmax.py``) held to their reference
(``kernels/head/naive.py``) and, through the whole compact head, to dense float64 log-softmax: on CPU
under the Triton interpreter (in a subprocess), and on the GPU at a real vocabulary's width."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harts.kernels.head import naive, softmax
from tests.helpers.interpreter import run_under_interpreter


def test_the_reference_gives_log_sum_exp_entropy_and_their_gradient():
    logits = torch.tensor([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]], dtype=torch.float64, requires_grad=True)
    lse, entropy = naive.row_lse_entropy(logits, True)
    assert torch.allclose(entropy[1], torch.log(torch.tensor(3.0, dtype=torch.float64)))
    row_grad, entropy_grad = torch.tensor([0.5, -2.0], dtype=torch.float64), torch.tensor([1.5, 0.25], dtype=torch.float64)
    # d lse / dz = p and d entropy / dz = -p (z - E_p[z]): the closed form (given -row_grad) against autograd
    (auto,) = torch.autograd.grad((row_grad * lse).sum() + (entropy_grad * entropy).sum(), logits)
    got = naive.softmax_backward(logits.detach(), lse.detach(), -row_grad, entropy_grad, None)
    assert torch.allclose(got, auto)


def test_the_kernels_match_the_reference_under_the_interpreter():
    results = run_under_interpreter(Path(__file__).with_name("_head_cases.py"), timeout=900)
    assert results["examples"] >= 25 and results["tiles"] > 1 and results["head_examples"] >= 10, results
    for key in ("lse", "entropy", "grad", "grad_entropy", "head_log_probs", "head_entropy", "head_grad_hidden",
                "head_grad_weight"):
        assert results[key] < 1e-5, (key, results)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and softmax.TRITON_AVAILABLE), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_the_kernels_on_the_gpu_at_a_real_vocabulary(entropy_in_loss):
    torch.manual_seed(0)
    logits = torch.randn(37, 157184, device="cuda") * 4
    row_grad, entropy_grad = torch.randn(37, device="cuda"), torch.randn(37, device="cuda")
    lse, entropy = softmax.row_lse_entropy(logits, True)
    want_lse, want_entropy = naive.row_lse_entropy(logits.double(), True)
    assert float((lse - want_lse).abs().max()) < 1e-4 and float((entropy - want_entropy).abs().max()) < 1e-4
    grad = entropy_grad if entropy_in_loss else None
    expected = (want_lse - want_entropy).float() if entropy_in_loss else None
    got = softmax.softmax_backward_(logits.clone(), lse, row_grad, grad, expected)
    want = naive.softmax_backward(logits.double(), want_lse, row_grad.double(), None if grad is None else grad.double(), None)
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-4
