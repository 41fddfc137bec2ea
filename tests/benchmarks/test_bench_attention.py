"""The attention head-to-head of ``harts-bench --attention-bench`` at toy size on CPU.

On CPU the gathered path runs the reference kernel and the tree path its dense mask (no
FlexAttention backward there); both must agree, and the command must run end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import harts
from harts_bench.attention import PATHS, AttentionShape, bench_layout
from harts.codegen.fx import attention_kv_rows
from harts.runtime import HybridConfig
from harts.rollouts.workloads import swe_like_step
from tests.helpers import REPO



def test_attention_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "attention.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env.pop("HARTS_KERNELS", None)
    completed = subprocess.run(
        [sys.executable, "-m", "harts_bench.runtime", "--attention-bench", "--device", "cpu", "--preset", "tiny",
         "--tokens", "800", "--scale", "0.004", "--attention-repeats", "2", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert any(line.startswith("total:") for line in completed.stdout.splitlines()), completed.stdout[-2000:]
    results = json.loads(out.read_text())
    assert results["shape"]["kind"] == "mla" and results["shape"]["qk_head_dim"] != results["shape"]["v_head_dim"]
    assert results["backends"]["flex_tree"].startswith("dense")
    assert results["faster_forward_backward"] in ("gathered_varlen", "flex_tree")
    assert len(results["microbatches"]) == results["plan"]["microbatches"] >= 1
    for entry in results["microbatches"]:
        assert entry["gathered_kv_rows"] > entry["rows"], "the workload shares prefixes, so gathered KV duplicates rows"
        for name in PATHS:
            assert "error" not in entry[name], entry[name]
            assert 0 < entry[name]["forward_ms"] and 0 < entry[name]["forward_backward_ms"]
        assert entry["flex_tree"]["mask_build_seconds"] >= 0
        for name, agreement in entry["agreement"].items():
            assert agreement["max_abs"] > 0, name
            assert agreement["max_abs_diff"] < 1e-5 * max(1.0, agreement["max_abs"]), (name, agreement)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_both_paths_agree_in_float64(attention):
    config = HybridConfig.preset("tiny", attention=attention, dtype="float64")
    shape = AttentionShape.from_config(config)
    assert (shape.kv_heads < shape.heads) == (attention == "gqa")
    batch = swe_like_step(seed=2, scale=0.004, vocab_size=config.vocab_size)
    plan = harts.compile(batch, capacity=4096, chunk_size=16)
    layout = plan.layout(0)
    entry = bench_layout(layout, shape, torch.device("cpu"), torch.float64, warmup=1, repeats=1, seed=0)
    assert entry["gathered_kv_rows"] == attention_kv_rows(layout)[0].shape[0]
    for name, agreement in entry["agreement"].items():
        assert agreement["max_abs_diff"] < 1e-12 * max(1.0, agreement["max_abs"]), (name, agreement)
