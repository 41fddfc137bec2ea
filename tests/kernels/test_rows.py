"""Row packing with a once-per-row backward (``kernels/rows/packed.py``) held to plain
``index_select`` / ``cat`` under autograd (``kernels/rows/naive.py``), forward and backward, on
random index sets: repeats, contiguous ranges (returned as views), empty outputs, rows gathered
nowhere, outputs without a gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.kernels.rows import naive
from harts.kernels.rows.packed import RowGather, RowScatter


@st.composite
def gathers(draw):
    num_rows = draw(st.integers(1, 40))
    outputs = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["range", "random", "empty"]))
        if kind == "range":
            start = draw(st.integers(0, num_rows - 1))
            outputs.append(np.arange(start, draw(st.integers(start + 1, num_rows))))
        elif kind == "random":
            outputs.append(np.array(draw(st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=60))))
        else:
            outputs.append(np.zeros(0, dtype=np.int64))
    used = draw(st.lists(st.booleans(), min_size=len(outputs), max_size=len(outputs)))
    return num_rows, outputs, used


@settings(max_examples=150, deadline=None)
@given(gathers(), st.integers(0, 2**31 - 1), st.booleans())
def test_row_gather_matches_index_select(case, seed, strided):
    """Also from a strided source (columns of a wider tensor, as a split of a fused projection),
    which the gather makes contiguous once before its index_selects."""
    num_rows, rows, used = case
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_rows, 3, 4 if strided else 2, dtype=torch.float64, generator=generator)
    weights = [torch.randn(r.size, 3, 2, dtype=torch.float64, generator=generator) for r in rows]

    def loss(outputs, leaf):
        terms = [(o * w).sum() for o, w, u in zip(outputs, weights, used) if u]
        return sum(terms, (0 * leaf).sum())  # the zero term keeps the graph when no output is used

    def source(leaf):
        return leaf[..., 1:3] if strided else leaf

    x_ref = wide.clone().requires_grad_()
    want = naive.gather_rows(source(x_ref), rows)
    loss(want, x_ref).backward()

    x = wide.clone().requires_grad_()
    got = RowGather(num_rows, rows)(source(x))
    assert len(got) == len(rows)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    loss(got, x).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def test_a_contiguous_range_is_a_view_and_a_permutation_needs_no_zeros():
    x = torch.arange(12.0).view(6, 2).requires_grad_()
    gather = RowGather(6, [np.arange(2, 5), np.array([5, 0, 1, 3])])
    assert gather.covers_all_rows
    middle, rest = gather(x)
    assert middle.data_ptr() == x[2].data_ptr()
    (middle.sum() * 2 + (rest * torch.arange(4.0)[:, None]).sum()).backward()
    # rows 2-4 from the range (weight 2), rows 5, 0, 1 from the list (weights 0, 1, 2), row 3 twice
    assert x.grad[:, 0].tolist() == [1.0, 2.0, 2.0, 2.0 + 3.0, 2.0, 0.0]


def test_row_gather_rejects_rows_outside_the_source():
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        RowGather(4, [np.array([0, 4])])
    with pytest.raises(ValueError, match="built for 4 rows"):
        RowGather(4, [np.array([0])])(torch.zeros(5))


@st.composite
def scatters(draw):
    """A compact tensor split into pieces, each piece written by one packed input at distinct positions."""
    num_rows = draw(st.integers(1, 30))
    order = np.array(draw(st.permutations(list(range(num_rows)))))
    cuts = sorted(draw(st.lists(st.integers(0, num_rows), max_size=3)))
    pieces = np.split(order, cuts)
    if draw(st.booleans()):  # sorted pieces: contiguous destinations, as a plan's rounds are
        pieces = np.split(np.arange(num_rows), cuts)
    destinations, positions, lengths = [], [], []
    for piece in pieces:
        extra = draw(st.integers(0, 5))
        length = piece.size + extra
        where = np.array(draw(st.permutations(list(range(length)))))[: piece.size]
        if draw(st.booleans()):
            where = np.sort(where)
        destinations.append(piece)
        positions.append(where)
        lengths.append(length)
    return num_rows, destinations, positions, lengths


@settings(max_examples=150, deadline=None)
@given(scatters(), st.integers(0, 2**31 - 1))
def test_row_scatter_matches_index_select_and_cat(case, seed):
    num_rows, destinations, positions, lengths = case
    generator = torch.Generator().manual_seed(seed)
    packed = [torch.randn(n, 4, dtype=torch.float64, generator=generator) for n in lengths]
    weight = torch.randn(num_rows, 4, dtype=torch.float64, generator=generator)

    ref_inputs = [p.clone().requires_grad_() for p in packed]
    want = naive.scatter_rows(ref_inputs, destinations, positions, num_rows)
    (want * weight).sum().backward()

    inputs = [p.clone().requires_grad_() for p in packed]
    got = RowScatter(num_rows, destinations, positions, lengths)(*inputs)
    assert torch.equal(got, want)
    (got * weight).sum().backward()
    for a, b in zip(inputs, ref_inputs):
        assert torch.equal(a.grad, b.grad)


def test_row_scatter_needs_every_row_written_once():
    with pytest.raises(ValueError, match="exactly once"):
        RowScatter(3, [np.array([0, 1])], [np.array([0, 1])], [2])
    with pytest.raises(ValueError, match="exactly once"):
        RowScatter(2, [np.array([0, 0])], [np.array([0, 1])], [2])
    with pytest.raises(ValueError, match="input 0"):
        RowScatter(2, [np.array([0, 1])], [np.array([0, 2])], [2])
