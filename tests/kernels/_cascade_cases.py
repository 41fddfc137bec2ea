"""Cases for the cascade attention's merge kernel, run by ``test_attention_cascade.py`` in a subprocess.

``TRITON_INTERPRET=1`` must be set before triton is imported and must not leak into the test process,
so the kernel runs here, in a child, on random merges drawn by hypothesis, and on a whole cascade program
(whose backward then sums with the row-sum kernel), and prints one JSON line of the largest errors.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

RESULTS = {"examples": 0, "rows_without_parts": 0, "merge_error": 0.0, "lse_error": 0.0, "program_error": 0.0}


@st.composite
def merges(draw):
    num_rows = draw(st.integers(1, 10))
    # which row each further part belongs to: rows with none, one, several
    owners = draw(st.lists(st.integers(0, num_rows - 1), min_size=0, max_size=25))
    heads = draw(st.integers(1, 3))
    width = draw(st.sampled_from([1, 5, 8, 24]))
    return num_rows, np.asarray(owners, dtype=np.int64), heads, width


@settings(max_examples=40, deadline=None, derandomize=True)
@given(merges(), st.integers(0, 2**31 - 1))
def check(case, seed):
    from harts.kernels.attention import cascade, naive
    from harts.kernels.rows.segment_sum import csr_by_row

    num_rows, owners, heads, width = case
    generator = torch.Generator().manual_seed(seed)
    o = torch.randn(num_rows, heads, width, generator=generator)
    lse = 3 * torch.randn(heads, num_rows, generator=generator)
    o_parts = torch.randn(owners.size, heads, width, generator=generator)
    lse_parts = 3 * torch.randn(heads, owners.size, generator=generator)
    offsets, positions = (torch.as_tensor(a) for a in csr_by_row(owners, num_rows))
    want_o, want_lse = naive.merge_attention_parts(o.double(), lse.double(), o_parts.double(), lse_parts.double(),
                                                   offsets, positions)
    got_o, got_lse = cascade.merge_attention_parts(o.clone(), lse.clone(), o_parts, lse_parts, offsets, positions)
    RESULTS["merge_error"] = max(RESULTS["merge_error"], float((got_o.double() - want_o).abs().max()))
    RESULTS["lse_error"] = max(RESULTS["lse_error"], float((got_lse.double() - want_lse).abs().max()))
    RESULTS["rows_without_parts"] += int(np.unique(owners).size < num_rows)
    RESULTS["examples"] += 1


def check_program():
    """A forked plan's cascade program (merge kernel forward, row-sum kernel backward) against the gathered view."""
    from harts.codegen.fx import build_attention_program, build_cascade_attention_program
    from harts.kernels import naive as naive_kernels
    from tests.helpers import make_plan
    from tests.helpers.runtime import forked_batch

    plan = make_plan(forked_batch(4), 4)
    for m in range(len(plan.module.microbatches)):
        layout = plan.layout(m)
        generator = torch.Generator().manual_seed(m)
        inputs = [torch.randn(layout.num_rows, 2, 8, generator=generator).requires_grad_() for _ in range(3)]
        weight = torch.randn(layout.num_rows, 2, 8, generator=generator)
        outs = []
        for program in (build_attention_program(layout, naive_kernels), build_cascade_attention_program(layout, naive_kernels)):
            o = program(*inputs, 0.3)
            outs.append((o, *torch.autograd.grad((o * weight).sum(), inputs)))
        for a, b in zip(*outs):
            RESULTS["program_error"] = max(RESULTS["program_error"], float((a - b).detach().abs().max() / b.detach().abs().max()))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("set TRITON_INTERPRET=1: the cases run the Triton kernel on the CPU interpreter")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    check()
    check_program()
    print(json.dumps(RESULTS))
