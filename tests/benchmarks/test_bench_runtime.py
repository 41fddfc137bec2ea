"""``harts-bench`` end to end at toy size on CPU, and the runtime on CUDA against the references."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tests.helpers import REPO



#: a pipeline other than the default (rounds chosen for shorter state-scan chains), through --pipeline
PIPELINE = ("lower,prefix-compress,partition-microbatches,schedule-slots,segment,"
            "min-call-rounds{shorten_critical_path=true},lay-out")


def test_bench_runtime_smoke_on_cpu(tmp_path):
    """Both baselines, HARTS and the ablations on the reference kernels: the figures tie together."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "harts_bench.runtime", "--device", "cpu", "--preset", "tiny",
         "--layers", "2", "--tokens", "800", "--scale", "0.004", "--warmup", "1", "--repeats", "1",
         "--kernels", "naive", "--train-step", "--packed-linear-rows", "--cascade-attention",
         "--keep-linear-intermediates", "--pipeline", PIPELINE, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    headline = [line for line in completed.stdout.splitlines() if line.startswith("headline-fla:")]
    assert len(headline) == 1
    fields = dict(item.split("=") for item in headline[0].split()[1:])
    assert set(fields) == {"compression", "speedup_vs_fla_baseline", "core_vs_fla_baseline",
                           "speedup_vs_own_baseline", "cosine", "first_step_seconds"}
    results = json.loads(out.read_text())
    assert float(fields["compression"]) == pytest.approx(results["compression"], rel=1e-3)
    assert results["compression"] > 1.0
    assert results["fidelity"]["cosine"] > 0.999999
    assert results["fidelity"]["rerun_cosine"] > 0.999999
    assert results["gradient_cosine"] > 0.999999
    assert results["mean_abs_logprob_delta"] < 1e-5
    # without fla the stock baseline runs the same reference kernels as the own baseline
    assert results["fla"] is False
    assert results["baseline_fla"]["loss"] == pytest.approx(results["baseline"]["loss"], rel=1e-6)
    # the timed plan was compiled by the pipeline given
    assert "shorten_critical_path=true" in results["plan"]["pipeline"]
    # the linear-attention layers on the packed rows compute the same pass
    assert results["harts_packed_linear_rows"]["loss"] == pytest.approx(results["harts"]["loss"], rel=1e-6)
    # the full-attention layers split at the forks compute the same pass
    assert results["harts_cascade_attention"]["loss"] == pytest.approx(results["harts"]["loss"], rel=1e-6)
    # and with the linear-attention intermediates kept from the recompute
    assert results["harts_keep_linear_intermediates"]["loss"] == pytest.approx(results["harts"]["loss"], rel=1e-6)
    # the training step `harts train` runs computes the same objective as the benchmark's pass, in both modes
    train = results["train_step"]
    for mode in ("harts", "baseline"):
        assert train[mode]["loss"] == pytest.approx(results["harts"]["loss"], rel=1e-5)
        assert train[mode]["rows_per_second"] > 0
    train_line = [line for line in completed.stdout.splitlines() if line.startswith("headline-train:")]
    assert len(train_line) == 1
    train_fields = dict(item.split("=") for item in train_line[0].split()[1:])
    assert float(train_fields["train_vs_bench_harts"]) == pytest.approx(
        train["harts"]["mean_fbgrad_seconds"] / results["harts"]["mean_seconds"], rel=1e-3)
    calls = results["linear_attention_calls_per_microbatch"]
    assert calls["harts"] >= 1
    assert calls["node_at_a_time"] == sum(results["plan"]["trie_nodes_per_microbatch"]) / results["plan"]["microbatches"]
    assert calls["node_at_a_time"] >= calls["sequence_at_a_time"] >= calls["harts"]
    assert results["node_at_a_time_mean_abs_logprob_delta"] < 1e-5
    # in float32 both views are the baseline's function up to round-off, each bounded on its own: which
    # rounds closer depends on the CPU's vector width (no replay is exact in float64: tests/runtime/test_ablation.py)
    ablation = results["replay_ablation"]
    deep = [str(d) for d in range(1, 6) if ablation["no_replay"][str(d)]["tokens"]]
    assert deep
    assert all(ablation["replay"][d]["mean_abs_delta_nll"] < 1e-5 for d in deep)
    assert all(ablation["no_replay"][d]["mean_abs_delta_nll"] < 1e-4 for d in deep)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_plan_on_fast_kernels_matches_the_baseline_on_the_references():
    """A tiny hybrid model on CUDA: a compiled plan on the fast kernels vs the baseline on the references."""
    import harts
    from harts.kernels import Dispatch
    from harts.kernels.linear_attention.chunk import fla_available
    from harts.runtime import HybridConfig, HybridModel, log_probs, log_probs_baseline
    from harts.rollouts.workloads import swe_like_step

    if not fla_available():
        pytest.skip("flash-linear-attention is not installed")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = HybridModel(HybridConfig.preset("tiny", num_layers=4))
    batch = swe_like_step(seed=2, scale=0.01, vocab_size=model.config.vocab_size)
    plan = harts.compile(batch, capacity=65536, chunk_size=64)
    fast = log_probs(model, plan, batch, recompute=True, kernels=Dispatch("fast"))
    grads_fast = torch.autograd.grad(fast.packed.sum(), list(model.parameters()), allow_unused=True)
    ref = log_probs_baseline(model, batch, recompute=True, kernels=Dispatch("naive"))
    grads_ref = torch.autograd.grad(ref.packed.sum(), list(model.parameters()), allow_unused=True)

    def rel(a, b):
        return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30))

    assert rel(fast.packed, ref.packed) < 1e-3
    for a, b in zip(grads_fast, grads_ref):
        assert (a is None) == (b is None)
        if b is not None and b.norm() > 0:
            assert rel(a, b) < 1e-2
