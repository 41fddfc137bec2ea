"""HARTS' Triton state kernels (fp32 exports in the forward scan, injected gradients in the reverse
scan) held to the pure-torch scan, on CPU under the Triton interpreter (in one subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.interpreter import run_under_interpreter

CASES = Path(__file__).with_name("_state_cases.py")


@pytest.fixture(scope="module")
def interpreter_errors():
    return run_under_interpreter(CASES, timeout=600)


@pytest.mark.parametrize("case", [0, 1, 2, 3])
def test_forward_scan_writes_every_chunk_start_the_final_and_the_exported_states(interpreter_errors, case):
    errors = interpreter_errors[case]
    assert errors["exports"] > 0
    for name in ("h", "v_new", "final", "exported"):
        assert errors[name] < 1e-5, (name, errors)


@pytest.mark.parametrize("case", [0, 1, 2, 3])
def test_reverse_scan_injects_the_exported_state_gradients(interpreter_errors, case):
    errors = interpreter_errors[case]
    for name in ("dh", "dh0", "dv2"):
        assert errors[name] < 1e-5, (name, errors)


def _block(value_dim, dtype, programs, monkeypatch, multiprocessors=132, scan="forward"):
    import torch

    from harts.kernels.linear_attention import state

    monkeypatch.setitem(state._SM_COUNTS, 0, multiprocessors)
    return state._launch_shape(value_dim, dtype, programs, torch.device("cuda", 0), scan=scan)[0]


def test_scans_with_few_sequences_split_their_value_columns_finer(monkeypatch):
    import torch

    bf16 = torch.bfloat16
    # one long shared prompt over 16 heads: 32 CTAs at fla's 64 columns, 128 at 16
    assert _block(128, bf16, 16, monkeypatch) == 16
    assert _block(128, bf16, 8 * 16, monkeypatch) == 32
    # the reverse scan splits only below one CTA per multiprocessor
    assert _block(128, bf16, 8 * 16, monkeypatch, scan="reverse") == 64
    assert _block(128, bf16, 16, monkeypatch, scan="reverse") == 16
    # enough sequences to fill the GPU twice over keep fla's tuned block
    assert _block(128, bf16, 20 * 16, monkeypatch) == 64
    assert _block(128, torch.float32, 20 * 16, monkeypatch) == 32
    assert _block(8, bf16, 1, monkeypatch) == 16


def test_only_forward_scans_split_for_latency_prefetch_a_chunk_further(monkeypatch):
    import torch

    from harts.kernels.linear_attention import state

    monkeypatch.setitem(state._SM_COUNTS, 0, 132)
    cuda = torch.device("cuda", 0)
    assert state._launch_shape(128, torch.bfloat16, 16, cuda) == (16, 3)
    assert state._launch_shape(128, torch.bfloat16, 8 * 16, cuda) == (32, 3)
    assert state._launch_shape(128, torch.bfloat16, 20 * 16, cuda) == (64, 2)
    assert state._launch_shape(128, torch.bfloat16, 16, cuda, scan="reverse") == (16, 2)
    assert state._launch_shape(128, torch.float32, 1, cuda) == (16, 1)


def test_a_block_override_must_be_a_power_of_two(monkeypatch):
    import torch

    from harts.kernels.linear_attention import state

    assert state._launch_shape(128, torch.bfloat16, 1, torch.device("cpu"), block_v=32) == (32, 2)
    with pytest.raises(ValueError, match="power of two"):
        state._launch_shape(128, torch.bfloat16, 1, torch.device("cpu"), block_v=24)
