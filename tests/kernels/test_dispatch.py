"""Kernel dispatch: modes, per-call selection, and the reference signatures."""

from __future__ import annotations

import inspect

import pytest
import torch

from harts.kernels import Dispatch, dispatch, naive


def linear_inputs(dtype=torch.float32):
    q = torch.randn(9, 2, 8, dtype=dtype)
    return q, q.clone(), torch.randn(9, 2, 4, dtype=dtype), -torch.rand(9, 2, 8, dtype=dtype), torch.rand(9, 2, dtype=dtype)


def test_mode_comes_from_the_environment_once():
    assert dispatch.mode_from_environment({}) == "auto"
    assert dispatch.mode_from_environment({"HARTS_KERNELS": " Naive "}) == "naive"
    with pytest.raises(ValueError, match="HARTS_KERNELS must be one of"):
        dispatch.mode_from_environment({"HARTS_KERNELS": "fastest"})
    with pytest.raises(ValueError, match="kernel mode must be one of"):
        Dispatch("fastest")


def test_cpu_inputs_run_the_references():
    q, k, v, g, beta = linear_inputs()
    for mode in ("auto", "naive"):
        kernels = Dispatch(mode)
        assert not kernels.uses_fast_linear_attention(q, k, v, 64)
        assert not kernels.uses_fast_attention(q)
        assert not kernels.uses_grouped_experts(q)
    cu = torch.tensor([0, 4, 9])
    got = Dispatch("auto").chunk_linear_attention(q, k, v, g, beta, cu, chunk_size=4, scale=0.5, export_chunks=[[1], [2]])
    want = naive.chunk_linear_attention(q, k, v, g, beta, cu, chunk_size=4, scale=0.5, export_chunks=[[1], [2]])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fast_mode_refuses_to_fall_back_for_linear_attention():
    q, k, v, _, _ = linear_inputs()
    with pytest.raises(RuntimeError, match="'fast'.*does not cover these inputs"):
        Dispatch("fast").uses_fast_linear_attention(q, k, v, 64)


def test_float64_always_takes_the_exact_reference():
    q, k, v, _, _ = linear_inputs(torch.float64)
    assert not Dispatch("fast").uses_fast_linear_attention(q, k, v, 64)


@pytest.mark.parametrize("name", ["chunk_linear_attention", "causal_conv1d", "attention", "moe_experts"])
def test_dispatch_has_the_reference_signatures(name):
    reference = inspect.signature(getattr(naive, name))
    assert list(inspect.signature(getattr(dispatch, name)).parameters) == list(reference.parameters)
    assert list(inspect.signature(getattr(Dispatch("naive"), name)).parameters) == list(reference.parameters)


def test_convolution_runs_the_reference_off_the_gpu_and_in_float64():
    x, weight = torch.randn(5, 8), torch.randn(8, 4)
    for mode in ("auto", "fast", "naive"):
        assert not Dispatch(mode).uses_fast_conv(x, weight, None, "silu")
        assert not Dispatch(mode).uses_fast_conv(x.double(), weight.double(), None, "silu")
