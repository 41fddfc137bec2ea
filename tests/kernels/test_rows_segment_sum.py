"""The row-sum kernel of a single-output gather's backward (``kernels/rows/segment_sum.py``) held to
its pure-torch reference and to ``index_select`` under autograd: on CPU under the Triton
interpreter (in a subprocess), and on the GPU at the size of a real key/value view."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from harts.kernels.rows import naive
from harts.kernels.rows.packed import RowGather
from harts.kernels.rows.segment_sum import TRITON_AVAILABLE, csr_by_row
from tests.helpers.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("_segment_sum_cases.py")


def test_csr_groups_every_position_under_the_row_it_reads():
    rows = np.array([3, 0, 3, 1, 3, 0])
    offsets, positions = csr_by_row(rows, 5)
    assert offsets.tolist() == [0, 2, 3, 3, 6, 6]  # row 2 and row 4 are read nowhere
    assert positions.tolist() == [1, 5, 3, 0, 2, 4]
    for row in range(5):
        assert set(rows[positions[offsets[row]:offsets[row + 1]]].tolist()) <= {row}


def test_the_reference_sums_each_rows_reads():
    rows = np.array([2, 0, 2, 2])
    offsets, positions = (torch.as_tensor(a) for a in csr_by_row(rows, 3))
    grad = torch.arange(8, dtype=torch.float32).view(4, 2)
    got = naive.segment_sum_reference(grad, offsets, positions, 3)
    assert got.tolist() == [[2.0, 3.0], [0.0, 0.0], [0.0 + 4 + 6, 1.0 + 5 + 7]]


def test_the_reference_starts_from_a_base_and_writes_into_it():
    rows = np.array([2, 0, 2])
    offsets, positions = (torch.as_tensor(a) for a in csr_by_row(rows, 3))
    grad = torch.arange(6, dtype=torch.float32).view(3, 2)
    base = torch.ones(3, 2)
    got = naive.segment_sum_reference(grad, offsets, positions, 3, base=base)
    assert got.data_ptr() == base.data_ptr()
    assert got.tolist() == [[3.0, 4.0], [1.0, 1.0], [1.0 + 0 + 4, 1.0 + 1 + 5]]


def test_the_kernel_matches_the_reference_under_the_interpreter():
    results = run_under_interpreter(CASES, timeout=900)
    assert results["examples"] >= 30
    assert results["repeated_rows"] > 0 and results["rows_read_nowhere"] > 0 and results["column_blocks"] > 1
    # fp32 sums in the reference's order: float32 agrees to rounding; bfloat16 to one final rounding
    # (the interpreter's float32 -> bfloat16 conversion may round differently from torch's)
    assert results["kernel_error"]["float32"] < 1e-6 and results["gather_error"]["float32"] < 1e-6, results
    assert results["kernel_error"]["bfloat16"] < 1e-2 and results["gather_error"]["bfloat16"] < 1e-2, results
    # with a base row to start from, the same sums written into the base
    assert results["base_error"]["float32"] < 1e-6 and results["base_error"]["bfloat16"] < 1e-2, results


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_key_value_view_backward_on_the_gpu_matches_index_select(dtype):
    # a shared prompt every branch re-reads, then each branch's own rows (the attention view of a plan)
    rng = np.random.default_rng(0)
    prompt = np.arange(0, 700)
    rows, start = [prompt], 700
    for _ in range(24):
        own = np.arange(start, start + int(rng.integers(1, 130)))
        start = own[-1] + 1
        rows.extend((prompt[: int(rng.integers(1, 700))], own))
    view = np.concatenate(rows)
    num_rows = int(start) + 5  # rows nobody reads
    generator = torch.Generator(device="cuda").manual_seed(0)
    source = torch.randn(num_rows, 3, 96, generator=generator, device="cuda").to(dtype)
    grad = torch.randn(view.size, 3, 96, generator=generator, device="cuda").to(dtype)
    x = source.clone().requires_grad_()
    gather = RowGather(num_rows, [view]).to("cuda")
    assert gather.sums_rows
    (out,) = gather(x)
    out.backward(grad)
    x_ref = source.double().requires_grad_()
    (ref,) = naive.gather_rows(x_ref, [view])
    ref.backward(grad.double())
    assert torch.equal(out, source[torch.as_tensor(view, device="cuda")])
    error = float((x.grad.double() - x_ref.grad).norm() / x_ref.grad.norm())
    assert error < (4e-3 if dtype == torch.bfloat16 else 1e-6)
    assert torch.count_nonzero(x.grad[-5:]) == 0
    # deterministic: a second backward gives the same bits
    x2 = source.clone().requires_grad_()
    gather(x2)[0].backward(grad)
    assert torch.equal(x2.grad, x.grad)
