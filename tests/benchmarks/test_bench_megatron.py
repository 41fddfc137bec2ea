"""``harts-bench --tp 1`` at toy size on CPU: the megatron-core path timed beside the native path and the baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytest.importorskip("megatron.core")


def test_bench_megatron_smoke_on_cpu(tmp_path):
    """The headline-mcore line: one process, TP = 1 (a one-process group), the tiny MoE preset on the references."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT="29613")
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "harts_bench.runtime", "--device", "cpu", "--preset", "tiny", "--layers", "2",
         "--tokens", "800", "--scale", "0.004", "--warmup", "1", "--repeats", "1", "--kernels", "naive",
         "--tp", "1", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    headline = [line for line in completed.stdout.splitlines() if line.startswith("headline-mcore:")]
    assert len(headline) == 1
    fields = dict(item.split("=", 1) for item in headline[0].split()[1:])
    assert set(fields) == {"tp", "ep", "ffn", "compression", "speedup_vs_fla_baseline", "native_ratio", "cosine",
                           "peak_gib_per_rank"}
    results = json.loads(out.read_text())
    assert (fields["tp"], fields["ep"], fields["ffn"]) == ("1", "1", "moe")
    assert results["compression"] > 1.0
    assert results["native_ratio"] > 0 and results["speedup_vs_fla_baseline"] > 0
    # the megatron path at TP = 1 computes the native loss; its log-probs agree with the baseline's
    assert results["megatron"]["loss"] == pytest.approx(results["native"]["loss"], rel=1e-6)
    assert results["megatron_baseline_fla"]["loss"] == pytest.approx(results["native"]["loss"], rel=1e-5)
    assert results["cosine"] > 0.999999
