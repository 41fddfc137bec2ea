"""Compact-to-semantic log-probs (Eq. 17-19): values, gradients and the memory they need.

Vocabulary-sized buffers are counted with a dispatch mode that records every tensor an
operator produces (forward and backward): with HARTS they have at most ``row_chunk`` (and
never more than C) rows, while S, the number of semantic positions, grows freely.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import harts
from harts.runtime import log_probs, log_probs_baseline
from harts.numerics import compact_log_probs
from tests.helpers import make_plan, tiny_model


class VocabularyBuffers(TorchDispatchMode):
    """Records the shape of every tensor produced whose last dimension is the vocabulary size."""

    def __init__(self, vocab_size: int, exclude: tuple[tuple[int, ...], ...] = ()):
        super().__init__()
        self.vocab_size = vocab_size
        self.exclude = set(exclude)
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == self.vocab_size:
                if tuple(tensor.shape) not in self.exclude:
                    self.shapes.append(tuple(tensor.shape))
        return out

    @property
    def max_rows(self) -> int:
        return max((int(np.prod(s[:-1])) for s in self.shapes), default=0)

    @property
    def total_elements(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)


def reference(hidden, weight, bias, rows, targets):
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    log_softmax = torch.log_softmax(logits, dim=-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_softmax[rows, targets], entropy[rows]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    positions=st.integers(0, 30),
    vocab=st.integers(2, 13),
    row_chunk=st.integers(1, 10),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_values_and_gradients_equal_dense_log_softmax(rows, positions, vocab, row_chunk, with_bias, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, generator=generator, requires_grad=True) if with_bias else None
    index = torch.randint(0, rows, (positions,), generator=generator)
    targets = torch.randint(0, vocab, (positions,), generator=generator)
    got, got_entropy = compact_log_probs(hidden, weight, bias, index, targets, with_entropy=True, row_chunk=row_chunk)
    want, want_entropy = reference(hidden, weight, bias, index, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=0, atol=1e-12)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    g1 = torch.randn(positions, dtype=torch.float64, generator=generator)
    g2 = torch.randn(positions, dtype=torch.float64, generator=generator)
    if positions == 0:
        return
    grads = torch.autograd.grad((got * g1).sum() + (got_entropy * g2).sum(), inputs)
    expected = torch.autograd.grad((want * g1).sum() + (want_entropy * g2).sum(), inputs)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), positions=st.integers(1, 30), vocab=st.integers(2, 13), row_chunk=st.integers(1, 10),
       seed=st.integers(0, 2**16))
def test_an_entropy_that_is_only_measured_costs_its_backward_nothing(rows, positions, vocab, row_chunk, seed):
    """Entropy read for a metric, loss on the log-probs alone: the same gradients as without the entropy,
    from a backward that forms no more [rows, V] buffers than the one without it."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    index = torch.randint(0, rows, (positions,), generator=generator)
    targets = torch.randint(0, vocab, (positions,), generator=generator)
    upstream = torch.randn(positions, dtype=torch.float64, generator=generator)
    grads, buffers = {}, {}
    for with_entropy in (False, True):
        values, entropy = compact_log_probs(hidden, weight, None, index, targets, with_entropy=with_entropy,
                                            row_chunk=row_chunk)
        assert (entropy is not None) == with_entropy
        with VocabularyBuffers(vocab) as recorder:
            grads[with_entropy] = torch.autograd.grad((values * upstream).sum(), (hidden, weight))
        buffers[with_entropy] = recorder.total_elements
    for measured, plain in zip(grads[True], grads[False]):
        torch.testing.assert_close(measured, plain, rtol=0, atol=0)
    assert buffers[True] == buffers[False]


def test_a_loss_on_the_entropy_alone_has_the_entropy_gradient():
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    rows = torch.tensor([0, 1, 1, 3, 2])
    targets = torch.tensor([1, 4, 0, 5, 2])
    _, entropy = compact_log_probs(hidden, weight, None, rows, targets, with_entropy=True, row_chunk=2)
    _, want = reference(hidden, weight, None, rows, targets)
    got = torch.autograd.grad(entropy.sum(), (hidden, weight))
    expected = torch.autograd.grad(want.sum(), (hidden, weight))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_shared_rows_with_different_targets():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=generator, requires_grad=True)
    rows = torch.tensor([0, 0, 0, 1, 2, 2, 3, 1])  # one row read by three positions with three labels
    targets = torch.tensor([1, 4, 6, 1, 0, 0, 3, 5])

    def run(h, w, b):
        values, entropy = compact_log_probs(h, w, b, rows, targets, with_entropy=True, row_chunk=3)
        return values, entropy

    assert torch.autograd.gradcheck(run, (hidden, weight, bias))


def test_bad_rows_and_targets_are_reported():
    hidden, weight = torch.randn(3, 2), torch.randn(5, 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compact_log_probs(hidden, weight, None, torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 3\)"):
        compact_log_probs(hidden, weight, None, torch.tensor([3]), torch.tensor([1]))
    with pytest.raises(ValueError, match="row_chunk"):
        compact_log_probs(hidden, weight, None, torch.tensor([0]), torch.tensor([1]), row_chunk=0)


def test_vocabulary_buffers_scale_with_rows_not_positions():
    """Ten times more positions over the same compact rows: identical vocabulary-sized work."""
    vocab, dim, rows, chunk = 997, 5, 24, 8
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, dim, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=generator, requires_grad=True)
    measured = []
    for positions in (50, 500):
        index = torch.randint(0, rows, (positions,), generator=generator)
        targets = torch.randint(0, vocab, (positions,), generator=generator)
        with VocabularyBuffers(vocab, exclude=((dim, vocab),)) as recorder:
            values, entropy = compact_log_probs(hidden, weight, None, index, targets, with_entropy=True, row_chunk=chunk)
            (values.sum() + entropy.sum()).backward()
        measured.append((recorder.max_rows, recorder.total_elements))
    assert measured[0] == measured[1]
    assert measured[0][0] == chunk
    # the instrument does see S x V when the rows are expanded to positions first
    with VocabularyBuffers(vocab, exclude=((dim, vocab),)) as recorder:
        expanded = torch.log_softmax(hidden[index] @ weight.t(), dim=-1)
        expanded[torch.arange(len(index)), targets].sum().backward()
    assert recorder.max_rows == 500


def test_runtime_vocabulary_buffers_have_compact_rows_only():
    """A heavily shared batch: HARTS forms at most C vocabulary rows, the baseline S."""
    prompt = list(range(1, 25))
    trajectories = [prompt + [30 + (i % 7), 40 + i % 5] for i in range(12)]
    batch = harts.RolloutBatch.from_trajectories(trajectories)
    plan = make_plan(batch, 4)
    model = tiny_model(vocab_size=97)  # a size no other dimension of the model has
    vocab, dim = model.config.vocab_size, model.config.hidden_size
    compact, semantic = plan.module.trie.compact_tokens, batch.semantic_tokens
    assert 3 * compact < semantic
    with VocabularyBuffers(vocab, exclude=((dim, vocab),)) as harts_buffers:
        out = log_probs(model, plan, batch, with_entropy=True)
        (out.packed.sum() + out.packed_entropy.sum()).backward()
    with VocabularyBuffers(vocab, exclude=((dim, vocab),)) as baseline_buffers:
        ref = log_probs_baseline(model, batch, with_entropy=True)
        (ref.packed.sum() + ref.packed_entropy.sum()).backward()
    model.zero_grad(set_to_none=True)
    assert harts_buffers.max_rows <= compact
    assert baseline_buffers.max_rows == semantic
    assert harts_buffers.total_elements * 3 < baseline_buffers.total_elements


def test_models_with_a_custom_head_use_compact_logits():
    """A head that is not a plain Linear still gets one logit row per compact row, not per position."""
    from harts.runtime import HybridModel

    class ScaledHead(HybridModel):
        def logits(self, hidden):
            return 0.5 * self.lm_head(hidden)

    base = tiny_model(vocab_size=97)
    model = ScaledHead(base.config)
    model.load_state_dict(base.state_dict())
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9]])
    plan = make_plan(batch, 4)
    with VocabularyBuffers(97, exclude=((model.config.hidden_size, 97),)) as buffers:
        out = log_probs(model, plan, batch, with_entropy=True)
    ref = log_probs_baseline(model, batch, with_entropy=True)
    assert buffers.max_rows == plan.module.trie.compact_tokens
    torch.testing.assert_close(out.packed, ref.packed, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.packed_entropy, ref.packed_entropy, rtol=0, atol=1e-10)
    plain = log_probs(base, plan, batch)
    assert not torch.allclose(plain.packed, out.packed)


@settings(max_examples=100, deadline=None)
@given(num_rows=st.integers(0, 10**6), vocab=st.integers(1, 10**6))
def test_default_row_blocks_fit_the_block_budget_in_whole_tiles(num_rows, vocab):
    from harts.numerics import DEFAULT_BLOCK_ELEMENTS, ROW_BLOCK_MULTIPLE, default_row_chunk

    rows = default_row_chunk(num_rows, vocab)
    assert 1 <= rows <= max(num_rows, 1)
    assert rows == 1 or rows * vocab <= DEFAULT_BLOCK_ELEMENTS
    if rows < num_rows and rows > ROW_BLOCK_MULTIPLE:
        assert rows % ROW_BLOCK_MULTIPLE == 0
    if rows < num_rows and rows > 1:  # no larger block of whole tiles (single rows below a tile) fits
        step = ROW_BLOCK_MULTIPLE if rows >= ROW_BLOCK_MULTIPLE else 1
        assert (rows + step) * vocab > DEFAULT_BLOCK_ELEMENTS
