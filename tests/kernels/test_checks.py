"""The host copy of cu_seqlens behind every kernel's bounds check: read once per tensor and version."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.kernels._checks import sequence_bounds


def test_the_same_tensor_is_read_once_and_its_bounds_cannot_be_written():
    cu = torch.tensor([0, 3, 7])
    first = sequence_bounds(cu, 7, "cu_seqlens")
    assert sequence_bounds(cu, 7, "cu_seqlens") is first
    assert first.tolist() == [0, 3, 7] and first.dtype == np.int64
    with pytest.raises(ValueError, match="read-only"):
        first[1] = 4


def test_an_in_place_change_is_read_again():
    cu = torch.tensor([0, 3, 7])
    sequence_bounds(cu, 7, "cu_seqlens")
    cu[1] = 5
    assert sequence_bounds(cu, 7, "cu_seqlens").tolist() == [0, 5, 7]
    cu[2:].add_(1)  # through a view: the version counter is shared
    with pytest.raises(ValueError, match="ends at 8"):
        sequence_bounds(cu, 7, "cu_seqlens")


def test_equal_tensors_do_not_share_an_entry_and_checks_run_on_every_call():
    a, b = torch.tensor([0, 2, 4]), torch.tensor([0, 2, 4])
    assert sequence_bounds(a, 4, "cu_seqlens") is not sequence_bounds(b, 4, "cu_seqlens")
    with pytest.raises(ValueError, match="ends at 4 but the packed tensor has 5 rows"):
        sequence_bounds(a, 5, "cu_seqlens")


def test_inference_tensors_are_read_without_a_version_counter():
    with torch.inference_mode():
        cu = torch.tensor([0, 1, 3])
    assert sequence_bounds(cu, 3, "cu_seqlens").tolist() == [0, 1, 3]
