"""``harts-bench --tp 1`` (and ``--ep 2`` under torchrun) at toy size on CPU: the megatron-core path timed beside the native path and the baseline."""

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


def test_bench_megatron_with_expert_parallelism_on_cpu(tmp_path):
    """``--ep 2 --moe-dispatcher alltoall`` under torchrun (2 ranks, gloo): the MoE preset's experts split over the
    ranks compute the native loss, and the line reports ep=2."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "harts_bench.runtime",
         "--device", "cpu", "--preset", "tiny", "--layers", "2", "--tokens", "800", "--scale", "0.004", "--warmup", "1",
         "--repeats", "1", "--kernels", "naive", "--tp", "1", "--ep", "2", "--moe-dispatcher", "alltoall", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    headline = [line for line in completed.stdout.splitlines() if line.startswith("headline-mcore:")]
    assert len(headline) == 1
    fields = dict(item.split("=", 1) for item in headline[0].split()[1:])
    assert (fields["tp"], fields["ep"], fields["ffn"]) == ("1", "2", "moe")
    results = json.loads(out.read_text())
    assert results["megatron"]["loss"] == pytest.approx(results["native"]["loss"], rel=1e-6)
    assert results["cosine"] > 0.999999
