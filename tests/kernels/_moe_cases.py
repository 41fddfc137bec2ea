"""Cases for the grouped experts' row-sum backward, run by ``test_moe.py`` in a subprocess under the
Triton interpreter (``TRITON_INTERPRET=1`` must not leak into the test process): random routings
drawn by hypothesis, the kernel path against the per-expert reference, forward and backward; prints
one JSON line with the number of examples and the largest relative errors."""

from __future__ import annotations

import json
import os
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

RESULTS = {"examples": 0, "kernel_path": 0, "y": 0.0, "dx": 0.0, "dweights": 0.0, "dgate_up": 0.0, "ddown": 0.0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.integers(1, 40), experts=st.integers(1, 6), top_k=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def check(rows, experts, top_k, seed):
    from harts.kernels.moe import grouped, naive
    from harts.kernels.rows.segment_sum import segment_sum_available

    top_k = min(top_k, experts)
    generator = torch.Generator().manual_seed(seed)
    hidden, intermediate = 8, 4
    gate_up = (torch.randn(experts, 2 * intermediate, hidden, generator=generator) * 0.5).requires_grad_()
    down = (torch.randn(experts, hidden, intermediate, generator=generator) * 0.5).requires_grad_()
    x = torch.randn(rows, hidden, generator=generator, requires_grad=True)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(rows)])
    weights = torch.rand(rows, top_k, generator=generator, requires_grad=True)
    params = (x, weights, gate_up, down)
    got = grouped.moe_experts(x, indices, weights, gate_up, down)
    want = naive.moe_experts(x, indices, weights, gate_up, down)
    grads = torch.autograd.grad(got.square().sum(), params)
    reference = torch.autograd.grad(want.square().sum(), params)
    RESULTS["y"] = max(RESULTS["y"], rel(got, want))
    for name, a, b in zip(("dx", "dweights", "dgate_up", "ddown"), grads, reference):
        RESULTS[name] = max(RESULTS[name], rel(a, b))
    RESULTS["examples"] += 1
    RESULTS["kernel_path"] += int(segment_sum_available(x))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("set TRITON_INTERPRET=1: the cases run the Triton kernel on the CPU interpreter")
    check()
    print(json.dumps(RESULTS))
