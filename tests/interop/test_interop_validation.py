"""Framework masks and offsets are read exactly or refused (issue 24): a verl/TRL/AReaL mask holds 0 or 1 only,
AReaL ``cu_seqlens`` are whole numbers, and a ``to_layout`` width is an integer of sane size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.errors import RolloutInputError
from harts.interop import from_areal, from_trl, from_verl, layout_spec
from harts.interop.framework_layouts import LayoutError
from tests.helpers import areal_packed, areal_padded, areal_rows, fixed_episodes, trl_batch, verl_batch

EPISODES = fixed_episodes()


def values_for(episodes, seed=0):
    rng = np.random.default_rng(seed)
    return [-rng.random(len(tokens) - 1).astype(np.float32) for tokens, _, _ in episodes]


@given(bad=st.sampled_from([-1, 2, 0.5, 3, -0.25]), row=st.integers(0, len(EPISODES) - 1), where=st.sampled_from(["prompt", "response"]))
def test_verl_attention_mask_values_other_than_0_and_1_are_refused(bad, row, where):
    d = verl_batch(EPISODES, values_for(EPISODES))
    attention = d["attention_mask"].astype(np.float64 if isinstance(bad, float) else np.int64)
    width = d["responses"].shape[1]
    column = attention.shape[1] - 1 if where == "prompt" else attention.shape[1] - width  # a real token's column
    column = column - width if where == "prompt" else column
    attention[row, column] = bad
    with pytest.raises(RolloutInputError, match=f"verl batch: row {row}: attention_mask of the {where}: column \\d+ is {bad!r}"):
        from_verl(dict(d, attention_mask=attention))


def test_verl_boolean_and_integer_masks_still_read():
    d = verl_batch(EPISODES, values_for(EPISODES))
    as_ints = from_verl(d)
    as_bools = from_verl(dict(d, attention_mask=d["attention_mask"].astype(bool)))
    assert [t.tolist() for t in as_ints.tokens] == [t.tolist() for t in as_bools.tokens]


def test_trl_masks_other_than_0_and_1_are_refused():
    t = trl_batch(EPISODES, values_for(EPISODES))
    mask = t["completion_mask"].astype(np.float64)
    mask[1, 0] = 0.5
    with pytest.raises(RolloutInputError, match="row 1: completion_mask: column 0 is 0.5"):
        from_trl(dict(t, completion_mask=mask))


def test_areal_padded_attention_mask_of_minus_one_is_refused():
    a = areal_padded(areal_rows(EPISODES, values_for(EPISODES)))
    attention = np.asarray(a["attention_mask"]).copy()
    attention[0, 0] = -1
    with pytest.raises(RolloutInputError, match="row 0: attention_mask: column 0 is -1"):
        from_areal(dict(a, attention_mask=attention), rolled=False)


@pytest.mark.parametrize("bad", [2.7, np.nan, np.inf])
def test_areal_cu_seqlens_that_are_not_whole_numbers_are_refused(bad):
    a = areal_packed(areal_padded(areal_rows(EPISODES, values_for(EPISODES))))
    cu = np.asarray(a["cu_seqlens"]).astype(np.float64)
    cu[1] = bad
    with pytest.raises(RolloutInputError, match="'cu_seqlens': entry 1 is .*not a whole number"):
        from_areal(dict(a, cu_seqlens=cu), rolled=False)


def test_areal_cu_seqlens_as_whole_floats_read_as_integers():
    a = areal_packed(areal_padded(areal_rows(EPISODES, values_for(EPISODES))))
    exact = from_areal(a, rolled=False)
    floats = from_areal(dict(a, cu_seqlens=np.asarray(a["cu_seqlens"]).astype(np.float64)), rolled=False)
    assert [t.tolist() for t in exact.tokens] == [t.tolist() for t in floats.tokens]


@pytest.mark.parametrize(("width", "message"), [(2.7, "must be an integer"), (True, "must be an integer"),
                                                ("64", "must be an integer"), (10**12, "slots, above"),
                                                (2**40, "slots, above")])
def test_to_layout_widths_that_are_not_integers_or_absurd_are_refused(width, message):
    batch = from_verl(verl_batch(EPISODES, values_for(EPISODES)))
    with pytest.raises(LayoutError, match=message):
        layout_spec(batch, "verl", width=width)


def test_a_sane_width_pads_to_it():
    d = verl_batch(EPISODES, values_for(EPISODES))
    batch = from_verl(d)
    assert layout_spec(batch, "verl", width=d["responses"].shape[1] + 3).shape == (len(EPISODES), d["responses"].shape[1] + 3)
