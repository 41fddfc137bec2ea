"""Run a script of Triton kernel cases on the CPU interpreter, in a child process.

``TRITON_INTERPRET=1`` must be set before triton is imported and must not leak into the test
process, so each kernel's cases live in a script that prints one JSON line as its last output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_under_interpreter(script: Path, timeout: float):
    """The script's last stdout line as JSON; skips the test where triton is not installed."""
    from harts.kernels.linear_attention.state import TRITON_AVAILABLE

    if not TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    completed = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])
