"""HARTS' Triton state kernels (fp32 exports in the forward scan, injected gradients in the reverse
scan) held to the pure-torch scan, on CPU under the Triton interpreter (in one subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harts.kernels.linear_attention.state import TRITON_AVAILABLE

CASES = Path(__file__).with_name("_state_cases.py")


@pytest.fixture(scope="module")
def interpreter_errors():
    if not TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    completed = subprocess.run([sys.executable, str(CASES)], env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [0, 1])
def test_forward_scan_writes_every_chunk_start_the_final_and_the_exported_states(interpreter_errors, case):
    errors = interpreter_errors[case]
    assert errors["exports"] > 0
    for name in ("h", "v_new", "final", "exported"):
        assert errors[name] < 1e-5, (name, errors)


@pytest.mark.parametrize("case", [0, 1])
def test_reverse_scan_injects_the_exported_state_gradients(interpreter_errors, case):
    errors = interpreter_errors[case]
    for name in ("dh", "dh0", "dv2"):
        assert errors[name] < 1e-5, (name, errors)
