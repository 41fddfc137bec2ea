"""Tune flash-linear-attention's kernels once on this GPU and write pinned configs for HARTS to ship.

fla autotunes every kernel on first use (minutes on an H200), and again for every new dtype.
A user's first training step should not pay that, so HARTS ships the tuned configs in
``kernels/fla_configs/<GPU>/`` and points fla at them (``FLA_CACHE_MODE=fuzzy``,
``FLA_CONFIG_DIR``; see :func:`harts.kernels.fla_setup.configure_fla`). Fuzzy
matching ignores numeric key entries (head counts, dims), so one tuned shape serves every
shape of the same dtypes.

This script runs, at the headline model's linear-attention shape (bf16, packed varlen with
initial states), forward + backward of HARTS' call with exports and of stock ``chunk_kda``
with and without initial states, so every kernel on both paths tunes; then it writes each
tuned kernel's configs as ``{kernel_name}.json`` in fla's config-file format. fp32 entries
are derived from the bf16 ones with at most 2 pipeline stages (an fp32 tile takes twice the
shared memory), so fp32 calls need no tuning either.

The causal convolution (fla's ``causal_conv1d`` with HARTS' context as its initial state) is
tuned at the model's conv shape in the same run; ``--only conv`` tunes and writes just those
kernels, leaving the other files in ``--out`` as they are.

Run on the GPU (fla installed, fresh process, no FLA_CACHE_MODE set)::

    python benchmarks/tune_fla.py --out configs_dir
    python benchmarks/tune_fla.py --out configs_dir --only conv
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch


def tuned_autotuners():
    from fla.ops.utils.cache import CachedAutotuner

    return [obj for obj in gc.get_objects() if isinstance(obj, CachedAutotuner) and obj.cache]


def config_entry(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def as_fp32_key(key: tuple) -> tuple | None:
    replaced = tuple("torch.float32" if entry in ("torch.bfloat16", "torch.float16") else entry for entry in key)
    return None if replaced == key else replaced


def write_configs(out: Path) -> list[str]:
    import triton
    from fla.ops.utils.cache import AutotuneKey

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for tuner in tuned_autotuners():
        entries = {}
        for key, config in tuner.cache.items():
            entry = config_entry(config)
            entries[AutotuneKey.key_hash(key)] = {"autotune_key": list(key), "config": entry}
            fp32 = as_fp32_key(key)
            if fp32 is not None and AutotuneKey.key_hash(fp32) not in entries:
                derived = dict(entry, num_stages=min(entry["num_stages"], 2))
                entries[AutotuneKey.key_hash(fp32)] = {"autotune_key": list(fp32), "config": derived, "derived": True}
        first = next(iter(tuner.cache.values()))
        document = {"kernel_name": tuner.kernel_name, "triton_version": triton.__version__,
                    "gpu": torch.cuda.get_device_name(), "autotune_entries": entries,
                    "default_config": config_entry(first)}
        path = out / f"{tuner.kernel_name}.json"
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        written.append(path.name)
    return sorted(written)


def tune_convolution(config, lengths: np.ndarray, started: float) -> None:
    """Forward + backward of fla's causal convolution at the model's conv shape, with and without context."""
    from harts.kernels.conv import fla as fla_conv

    channels = config.linear_conv_channels
    width = config.linear_conv_kernel_dim
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device="cuda")
    x = torch.randn(int(lengths.sum()), channels, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(channels, width, device="cuda") / width).bfloat16().requires_grad_()
    context = torch.randn(len(lengths), width - 1, channels, device="cuda").bfloat16().requires_grad_()
    for name, kwargs in (("causal conv, context", {"context": context}), ("causal conv, no context", {})):
        step = time.perf_counter()
        fla_conv.causal_conv1d(x, weight, None, cu, activation="silu", **kwargs).float().square().sum().backward()
        torch.cuda.synchronize()
        print(f"[{time.perf_counter() - started:7.1f}s] tuned {name} in {time.perf_counter() - step:.1f} s", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the {kernel_name}.json files")
    parser.add_argument("--preset", default="ling-3.0-tiny")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=64, help="the plans' chunk size B (fla's KDA kernels take 32 or 64)")
    parser.add_argument("--only", choices=("all", "conv"), default="all",
                        help="tune every kernel HARTS and the baseline run, or only the causal convolution")
    args = parser.parse_args(argv)
    if "FLA_CACHE_MODE" in os.environ:
        raise SystemExit("unset FLA_CACHE_MODE: this script must autotune")
    os.environ["FLA_CACHE_MODE"] = "disabled"  # stop HARTS from pointing fla at shipped configs

    from harts.kernels.linear_attention import chunk
    from harts.runtime import HybridConfig

    config = HybridConfig.preset(args.preset)
    heads, key_dim, value_dim = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    lengths = np.full(8, args.tokens // 8)
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device="cuda")
    total = int(lengths.sum())
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(total, heads, key_dim, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(total, heads, key_dim, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(total, heads, value_dim, device="cuda").bfloat16()
    g = -torch.rand(total, heads, key_dim, device="cuda") * 0.2
    beta = torch.rand(total, heads, device="cuda").bfloat16()
    h0 = torch.randn(len(lengths), heads, key_dim, value_dim, device="cuda") * 0.1
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, h0)]
    exports = [[1, 3], [2], [], [5], [], [], [1], [int(np.ceil(lengths[7] / args.chunk_size))]]
    started = time.perf_counter()
    tune_convolution(config, lengths, started)
    if args.only == "conv":
        written = write_configs(Path(args.out))
        print(f"wrote {len(written)} kernel configs to {args.out}: {', '.join(written)}", flush=True)
        print(f"tuning_seconds={time.perf_counter() - started:.1f}", flush=True)
        return
    for name, function, kwargs in (
        ("harts call with exports", chunk.chunk_linear_attention, {"initial_state": inputs[5], "export_chunks": exports}),
        ("stock chunk_kda, initial states", chunk.stock_chunk_kda, {"initial_state": inputs[5]}),
        ("stock chunk_kda, zero states", chunk.stock_chunk_kda, {}),
    ):
        step = time.perf_counter()
        o, final, exported = function(*inputs[:5], cu, chunk_size=args.chunk_size, scale=key_dim**-0.5, **kwargs)
        (o.float().sum() + final.sum() + exported.sum()).backward()
        torch.cuda.synchronize()
        print(f"[{time.perf_counter() - started:7.1f}s] tuned {name} in {time.perf_counter() - step:.1f} s", flush=True)
    written = write_configs(Path(args.out))
    print(f"wrote {len(written)} kernel configs to {args.out}: {', '.join(written)}", flush=True)
    print(f"tuning_seconds={time.perf_counter() - started:.1f}", flush=True)


if __name__ == "__main__":
    main()
