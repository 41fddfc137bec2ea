"""The pinned fla configs that ship with HARTS cover what dispatch sends to fla."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harts.kernels.fla_setup import CONFIG_ROOT, configure_fla

H200 = CONFIG_ROOT / "NVIDIA_H200"


def entries(kernel: str) -> list[list]:
    document = json.loads((H200 / f"{kernel}.json").read_text())
    assert document["kernel_name"] == kernel
    return [entry["autotune_key"] for entry in document["autotune_entries"].values()]


@pytest.mark.parametrize("kernel", ["causal_conv1d_fwd_kernel", "causal_conv1d_bwd_kernel"])
def test_conv_configs_cover_bf16_without_bias_with_and_without_context(kernel):
    """fla keys autotuning on every tensor argument's dtype: the dispatched call (bf16, no bias,
    silu; context or not) must find an entry, else the first step autotunes."""
    keys = [key for key in entries(kernel) if "torch.bfloat16" in key]
    # forward: x, y, weight [, initial_state] and the int32 cu_seqlens / chunk indices
    # backward: x, y (silu), weight, dy, dx [, initial_state], dw partials (fp32), int32 indices
    dtype_counts = sorted(sum(1 for entry in key if entry == "torch.bfloat16") for key in keys)
    base = 3 if kernel == "causal_conv1d_fwd_kernel" else 5
    assert dtype_counts == [base, base + 1]


def test_linear_attention_configs_ship_beside_the_conv_ones():
    names = {path.stem for path in H200.glob("*.json")}
    assert {"chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_kda_bwd_kernel_wy_dqkg_fused"} <= names


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only: without CUDA nothing is configured")
def test_configure_fla_leaves_the_environment_alone_without_a_gpu(monkeypatch):
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    assert configure_fla() is None
    assert "FLA_CACHE_MODE" not in os.environ and "FLA_CONFIG_DIR" not in os.environ
