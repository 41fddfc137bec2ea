"""fla's causal convolution with HARTS' per-sequence context, held to the pure-torch reference.

GPU only (fla's Triton kernels need CUDA): packed varlen sequences with odd lengths (one row,
fewer rows than the window, exactly the window, many rows), with and without true-ancestor
context, widths 2 and 4, in the configuration dispatch sends there (bf16, no bias, silu: the one
with shipped tuned configs), forward and the gradients of inputs, weights and context. The context path is what a forked branch sees: the rows before its fork.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.kernels.conv import fla as fla_conv
from harts.kernels.conv import naive

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
TOLERANCE = 1e-2  # bf16 inputs and outputs, fp32 accumulation


@pytest.fixture(scope="module", autouse=True)
def fla_installed():
    if not fla_conv.fla_conv_available(torch.zeros(1, 1, device=DEVICE, dtype=torch.bfloat16), torch.zeros(1, 4, device=DEVICE)):
        pytest.skip("flash-linear-attention is not installed")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("with_context", [True, False], ids=["context", "no-context"])
@pytest.mark.parametrize("width", [2, 4])
def test_fla_conv_matches_the_reference(with_context, width):
    lengths = [1, 3, 4, 5, 63, 64, 65, 200]
    channels = 96
    dtype = torch.bfloat16
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.as_tensor(bounds, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(width)
    x = torch.randn(int(bounds[-1]), channels, generator=generator, device=DEVICE).to(dtype).requires_grad_()
    weight = (torch.randn(channels, width, generator=generator, device=DEVICE) / width).to(dtype).requires_grad_()
    context = None
    if with_context:
        context = torch.randn(len(lengths), width - 1, channels, generator=generator, device=DEVICE)
        context = context.to(dtype).requires_grad_()
    leaves = [t for t in (x, weight, context) if t is not None]
    reference = [t.detach().double().requires_grad_() for t in leaves]
    ref_context = reference[2] if with_context else None

    y = fla_conv.causal_conv1d(x, weight, None, cu, context=context, activation="silu")
    want = naive.causal_conv1d(reference[0], reference[1], None, cu, context=ref_context, activation="silu")
    assert y.dtype == dtype and y.shape == want.shape
    assert relative_error(y, want) < TOLERANCE

    upstream = torch.randn(want.shape, generator=generator, device=DEVICE, dtype=torch.float64)
    got_grads = torch.autograd.grad((y.double() * upstream).sum(), leaves)
    want_grads = torch.autograd.grad((want * upstream).sum(), reference)
    for name, got, expected in zip(("x", "weight", "context"), got_grads, want_grads):
        assert got is not None, name
        assert relative_error(got, expected) < TOLERANCE, name


def test_fla_conv_context_of_a_fork_equals_the_unforked_sequence():
    """A branch resumed after its prefix with the prefix's last W-1 rows as context gives the rows
    the whole sequence gives there (what HARTS relies on at every fork)."""
    channels, width = 64, 4
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    whole = torch.randn(150, channels, generator=generator, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(channels, width, generator=generator, device=DEVICE, dtype=torch.bfloat16)
    full = fla_conv.causal_conv1d(whole, weight, None, torch.tensor([0, 150], device=DEVICE))
    for fork in (1, 2, 3, 63, 64, 65):
        context = torch.zeros(1, width - 1, channels, device=DEVICE, dtype=torch.bfloat16)
        history = whole[max(0, fork - (width - 1)) : fork]
        if history.shape[0]:
            context[0, width - 1 - history.shape[0] :] = history
        tail = fla_conv.causal_conv1d(whole[fork:], weight, None, torch.tensor([0, 150 - fork], device=DEVICE),
                                      context=context)
        assert torch.equal(tail, full[fork:]), fork


@pytest.mark.parametrize("width", [2, 4])
def test_head_windows_equal_fla_initial_states_bit_for_bit(width, monkeypatch):
    """The context reaches fla as recomputed head windows (two plain calls) or as fla's initial states:
    the outputs are identical and the gradients agree to bf16 rounding."""
    lengths = [1, 2, 3, 4, 5, 63, 64, 65, 200]
    channels = 96
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.as_tensor(bounds, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(10 + width)
    x = torch.randn(int(bounds[-1]), channels, generator=generator, device=DEVICE).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(channels, width, generator=generator, device=DEVICE) / width).to(torch.bfloat16).requires_grad_()
    context = torch.randn(len(lengths), width - 1, channels, generator=generator, device=DEVICE)
    context = context.to(torch.bfloat16).requires_grad_()
    upstream = torch.randn(int(bounds[-1]), channels, generator=generator, device=DEVICE)
    outputs, grads = [], []
    for by_windows in (True, False):
        monkeypatch.setattr(fla_conv, "CONTEXT_BY_HEAD_WINDOWS", by_windows)
        y = fla_conv.causal_conv1d(x, weight, None, cu, context=context, activation="silu")
        outputs.append(y)
        grads.append(torch.autograd.grad((y.float() * upstream).sum(), (x, weight, context)))
    assert torch.equal(outputs[0], outputs[1])
    for name, got, want in zip(("x", "weight", "context"), *grads):
        assert relative_error(got, want) < TOLERANCE, name


def test_dispatch_sends_only_tuned_gpu_convolutions_to_fla():
    from harts.kernels import Dispatch

    x, weight = torch.randn(5, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    low_x, low_weight = x.bfloat16(), weight.bfloat16()
    assert Dispatch("auto").uses_fast_conv(low_x, low_weight, None, "silu")
    assert not Dispatch("naive").uses_fast_conv(low_x, low_weight, None, "silu")
    # outside the tuned set (see harts.kernels.conv.fla): float32, float64, a bias, no activation
    assert not Dispatch("auto").uses_fast_conv(x, weight, None, "silu")
    assert not Dispatch("auto").uses_fast_conv(x.double(), weight.double(), None, "silu")
    assert not Dispatch("auto").uses_fast_conv(low_x, low_weight, torch.zeros(8, device=DEVICE), "silu")
    assert not Dispatch("auto").uses_fast_conv(low_x, low_weight, None, None)


def test_fla_conv_calls_after_the_first_never_wait_for_the_device():
    # every layer of a microbatch makes the same call: its index tensors are built once, so the
    # later calls queue their kernels without reading anything back from the GPU
    lengths = [5, 64, 65, 130]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.as_tensor(bounds, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(int(bounds[-1]), 64, generator=generator, device=DEVICE).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(64, 4, generator=generator, device=DEVICE) / 4).to(torch.bfloat16).requires_grad_()
    context = torch.randn(len(lengths), 3, 64, generator=generator, device=DEVICE).to(torch.bfloat16).requires_grad_()
    first = fla_conv.causal_conv1d(x, weight, None, cu, context=context, activation="silu")
    first.float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fla_conv.causal_conv1d(x, weight, None, cu, context=context, activation="silu")
        again.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, again)


def test_head_windows_backward_leaves_the_output_gradient_as_it_was():
    """The backward zeroes the head rows of the output gradient in place for its packed call and puts them
    back: the caller's gradient tensor is unchanged, and the input gradients equal those of the out-of-place
    mask (taken under create_graph, where the gradient may be saved) bit for bit."""
    lengths = [1, 2, 3, 4, 5, 63, 64, 65, 200]
    channels, width = 96, 4
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    cu = torch.as_tensor(bounds, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(21)
    x = torch.randn(int(bounds[-1]), channels, generator=generator, device=DEVICE).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(channels, width, generator=generator, device=DEVICE) / width).to(torch.bfloat16).requires_grad_()
    context = torch.randn(len(lengths), width - 1, channels, generator=generator, device=DEVICE)
    context = context.to(torch.bfloat16).requires_grad_()
    dy = torch.randn(int(bounds[-1]), channels, generator=generator, device=DEVICE).to(torch.bfloat16)
    before = dy.clone()
    grads = []
    for create_graph in (False, True):
        y = fla_conv.causal_conv1d(x, weight, None, cu, context=context, activation="silu")
        grads.append(torch.autograd.grad(y, (x, weight, context), grad_outputs=dy, create_graph=create_graph))
        assert torch.equal(dy, before), create_graph
    for name, in_place, copied in zip(("x", "weight", "context"), *grads):
        assert torch.equal(in_place, copied), name
