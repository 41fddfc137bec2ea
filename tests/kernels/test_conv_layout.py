"""The index tensors HARTS hands fla's causal conv (``kernels/conv/fla.py``), checked on CPU: fla
reads its (sequence, block) table instead of building it per call, so the table must be exactly
every sequence's blocks of 64 rows, in order, and the bounds must be the call's."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.kernels.conv import fla as fla_conv


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0, 1, 63, 64, 65, 127, 128, 129]), st.integers(0, 300)), min_size=1, max_size=12))
def test_the_block_table_lists_each_sequences_blocks_in_order(lengths):
    # lengths at and around the block size, and empty sequences, which own no block
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    device_bounds, host_bounds, table = fla_conv._call_layout(bounds, torch.device("cpu"))
    assert device_bounds.dtype == host_bounds.dtype == table.dtype == torch.int32
    assert device_bounds.tolist() == host_bounds.tolist() == bounds.tolist()
    want = [(sequence, block) for sequence, length in enumerate(lengths) for block in range(-(-length // 64))]
    assert [tuple(row) for row in table.tolist()] == want
    assert table.shape == (len(want), 2)


def test_the_same_bounds_reuse_the_same_tensors():
    bounds = np.array([0, 63, 127, 192])
    first = fla_conv._call_layout(bounds, torch.device("cpu"))
    again = fla_conv._call_layout(bounds.copy(), torch.device("cpu"))
    assert all(a is b for a, b in zip(first, again))
    other = fla_conv._call_layout(np.array([0, 63, 128, 192]), torch.device("cpu"))
    assert other[2].tolist() != first[2].tolist()
