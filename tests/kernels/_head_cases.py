"""Cases for the log-prob head's row-statistics kernels, run by ``test_head.py`` in a subprocess under the
Triton interpreter (``TRITON_INTERPRET=1`` must not leak into the test process). Random blocks drawn by
hypothesis (widths below, at and above a column tile, which the script lowers to 16; extreme logits)
against the float64 reference, and the whole compact log-prob head (forward, backward, with and without
the entropy's gradient) against dense float64 log-softmax. Prints one JSON line of examples and errors."""

from __future__ import annotations

import json
import os
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

RESULTS = {"examples": 0, "tiles": 0, "lse": 0.0, "entropy": 0.0, "grad": 0.0, "grad_entropy": 0.0,
           "head_examples": 0, "head_log_probs": 0.0, "head_entropy": 0.0, "head_grad_hidden": 0.0, "head_grad_weight": 0.0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(rows=st.integers(1, 6), width=st.sampled_from([1, 5, 16, 17, 40, 100]), spread=st.sampled_from([1.0, 30.0, 300.0]),
       seed=st.integers(0, 2**31 - 1))
def check_block(rows, width, spread, seed):
    from harts.kernels.head import naive, softmax

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=generator) * spread
    row_grad, entropy_grad = torch.randn(rows, generator=generator), torch.randn(rows, generator=generator)
    assert softmax.available(logits)
    lse, entropy = softmax.row_lse_entropy(logits, True)
    want_lse, want_entropy = naive.row_lse_entropy(logits.double(), True)
    # lse and entropy = lse - E_p[z] carry the rounding of the logits' magnitude (fp32 cancellation)
    scale = float(logits.abs().max().clamp_min(1.0))
    RESULTS["lse"] = max(RESULTS["lse"], float((lse.double() - want_lse).abs().max()) / scale)
    RESULTS["entropy"] = max(RESULTS["entropy"], float((entropy.double() - want_entropy).abs().max()) / scale)
    for name, grad in (("grad", None), ("grad_entropy", entropy_grad)):
        expected = None if grad is None else (want_lse - want_entropy).float()
        got = softmax.softmax_backward_(logits.clone(), lse, row_grad, grad, expected)
        want = naive.softmax_backward(logits.double(), want_lse, row_grad.double(),
                                      None if grad is None else grad.double(), None)
        RESULTS[name] = max(RESULTS[name], rel(got, want))
    RESULTS["examples"] += 1
    RESULTS["tiles"] = max(RESULTS["tiles"], -(-width // softmax.FORWARD_BLOCK))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(rows=st.integers(1, 8), positions=st.integers(1, 20), vocab=st.integers(2, 40), row_chunk=st.integers(1, 5),
       entropy_in_loss=st.booleans(), seed=st.integers(0, 2**31 - 1))
def check_head(rows, positions, vocab, row_chunk, entropy_in_loss, seed):
    from harts.numerics import compact_log_probs

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 6, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, 6, generator=generator, requires_grad=True)
    index = torch.randint(0, rows, (positions,), generator=generator)
    targets = torch.randint(0, vocab, (positions,), generator=generator)
    coef = torch.randn(positions, generator=generator)
    got, got_entropy = compact_log_probs(hidden, weight, None, index, targets, with_entropy=True, row_chunk=row_chunk)
    loss = (coef * got).sum() + (0.3 * got_entropy.sum() if entropy_in_loss else 0.0)
    grads = torch.autograd.grad(loss, (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    log_softmax = torch.log_softmax(h64 @ w64.t(), dim=-1)
    want = log_softmax[index, targets]
    want_entropy = -(log_softmax.exp() * log_softmax).sum(-1)[index]
    ref_loss = (coef.double() * want).sum() + (0.3 * want_entropy.sum() if entropy_in_loss else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, (h64, w64))
    RESULTS["head_log_probs"] = max(RESULTS["head_log_probs"], rel(got, want))
    RESULTS["head_entropy"] = max(RESULTS["head_entropy"], rel(got_entropy, want_entropy))
    RESULTS["head_grad_hidden"] = max(RESULTS["head_grad_hidden"], rel(grads[0], ref_grads[0]))
    RESULTS["head_grad_weight"] = max(RESULTS["head_grad_weight"], rel(grads[1], ref_grads[1]))
    RESULTS["head_examples"] += 1


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("set TRITON_INTERPRET=1: the cases run the Triton kernels on the CPU interpreter")
    from harts.kernels.head import softmax

    softmax.FORWARD_BLOCK = softmax.BACKWARD_BLOCK = 16  # several column tiles on small vocabularies
    check_block()
    check_head()
    print(json.dumps(RESULTS))
