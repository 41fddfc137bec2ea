"""Cases for the row-sum kernel of a gather's backward, run by ``test_rows_segment_sum.py`` in a subprocess.

``TRITON_INTERPRET=1`` must be set before triton is imported and must not leak into the test
process, so the kernel runs here, in a child, on random gathers drawn by hypothesis, and prints
one JSON line: how many examples ran and the largest error against the reference.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

RESULTS = {"examples": 0, "rows_read_nowhere": 0, "repeated_rows": 0, "column_blocks": 0,
           "kernel_error": {"float32": 0.0, "bfloat16": 0.0}, "gather_error": {"float32": 0.0, "bfloat16": 0.0},
           "base_error": {"float32": 0.0, "bfloat16": 0.0}}


@st.composite
def gathers(draw):
    num_rows = draw(st.integers(1, 12))
    # a row read many times (a shared prompt), rows read once, rows read nowhere
    rows = draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=40))
    # widths below, at and above one column block (the test lowers the block to 8)
    shape = draw(st.sampled_from([(1,), (3,), (8,), (2, 4), (19,), (3, 7)]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return num_rows, np.asarray(rows, dtype=np.int64), shape, dtype


@settings(max_examples=40, deadline=None, derandomize=True)
@given(gathers(), st.integers(0, 2**31 - 1))
def check(case, seed):
    from harts.kernels.rows import naive, segment_sum
    from harts.kernels.rows.packed import RowGather

    num_rows, rows, shape, dtype = case
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(rows.size, *shape, generator=generator).to(dtype)
    offsets, positions = (torch.as_tensor(a) for a in segment_sum.csr_by_row(rows, num_rows))
    got = segment_sum.segment_sum(grad, offsets, positions, num_rows)
    want = naive.segment_sum_reference(grad, offsets, positions, num_rows)
    assert got.dtype == grad.dtype and got.shape == (num_rows, *shape)
    scale = want.double().abs().max().clamp_min(1.0)
    name = str(dtype).removeprefix("torch.")
    RESULTS["kernel_error"][name] = max(RESULTS["kernel_error"][name], float((got.double() - want.double()).abs().max() / scale))

    # with a base: the sums start from it, in place
    base = torch.randn(num_rows, *shape, generator=generator).to(dtype)
    base_copy = base.clone()
    got = segment_sum.segment_sum(grad, offsets, positions, num_rows, base=base)
    want = naive.segment_sum_reference(grad, offsets, positions, num_rows, base=base_copy.clone())
    assert got.data_ptr() == base.data_ptr()
    exact = (base_copy.double() + naive.segment_sum_reference(grad.double(), offsets, positions, num_rows)).to(dtype)
    scale = exact.double().abs().max().clamp_min(1.0)
    RESULTS["base_error"][name] = max(RESULTS["base_error"][name], float((got.double() - want.double()).abs().max() / scale))

    # the module's backward routes through the kernel here (single output with repeats)
    source = torch.randn(num_rows, *shape, generator=generator).to(dtype)
    x = source.clone().requires_grad_()
    gather = RowGather(num_rows, [rows])
    (out,) = gather(x)
    out.backward(grad)
    x_ref = source.double().requires_grad_()
    (ref,) = naive.gather_rows(x_ref, [rows])
    ref.backward(grad.double())
    assert torch.equal(out, source[torch.as_tensor(rows)])
    error = float((x.grad.double() - x_ref.grad).abs().max() / x_ref.grad.abs().max().clamp_min(1.0))
    RESULTS["gather_error"][name] = max(RESULTS["gather_error"][name], error)
    RESULTS["examples"] += 1
    RESULTS["rows_read_nowhere"] += int(np.unique(rows).size < num_rows)
    RESULTS["repeated_rows"] += int(gather.sums_rows)
    RESULTS["column_blocks"] = max(RESULTS["column_blocks"], -(-int(np.prod(shape)) // segment_sum.MAX_BLOCK_COLUMNS))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("set TRITON_INTERPRET=1: the cases run the Triton kernel on the CPU interpreter")
    from harts.kernels.rows import segment_sum

    segment_sum.MAX_BLOCK_COLUMNS = 8  # several column blocks per row on small widths
    check()
    print(json.dumps(RESULTS))
