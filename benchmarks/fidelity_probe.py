"""Where do HARTS and the baseline part ways numerically? A GPU diagnostic for the §5.4 fidelity gap.

HARTS and the trajectory-wise baseline run the same math on differently packed rows. In exact
arithmetic they agree; in bf16 they agree bit for bit only where every operator computes a row
the same way whatever else is in its batch ("batch invariance"). This script measures:

1. ``ops``: for each operator of the hybrid block, the largest difference between a row computed
   inside a big packed batch and the same row computed in a small batch (bf16 GEMM as used by
   the projections, with cuBLAS' reduced-precision split-K reductions allowed and disallowed;
   grouped expert GEMMs; varlen attention; the chunkwise linear-attention kernel). Zero means
   the operator is batch invariant for these shapes.
2. ``layers``: the hidden state after every decoder block for a few trajectories, baseline vs
   HARTS and baseline vs the baseline packed one trajectory per call: the first block where the
   difference appears names the operator kind that causes it, and the growth over depth shows
   how the random-weight model amplifies it.

Run (H200)::

    PYTHONUNBUFFERED=1 python benchmarks/fidelity_probe.py --out $OUT/fidelity_probe.json

CPU smoke test (everything is batch invariant there, so differences print as 0)::

    python benchmarks/fidelity_probe.py --device cpu --preset tiny --tokens 3000 --scale 0.02 --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harts  # noqa: E402
from harts_bench.runtime import baseline_microbatches, select_trees  # noqa: E402
from harts.kernels import dispatch  # noqa: E402
from harts.runtime import BaselineView, HybridConfig, HybridModel, TreeView  # noqa: E402
from harts.runtime.view import linear_rows  # noqa: E402
from harts.rollouts.workloads import swe_like_step, trees_near_compression  # noqa: E402

logger = logging.getLogger("fidelity_probe")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@torch.no_grad()
def probe_ops(device: torch.device, dtype: torch.dtype, config: HybridConfig, chunk: int) -> dict:
    """Row-wise batch invariance of each operator: big packed batch vs a small batch holding the same rows."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    hidden = config.hidden_size
    results: dict = {}
    previous = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction

    def linear_rows(name: str, weight: torch.Tensor, x: torch.Tensor) -> None:
        """The first rows of a big GEMM vs the same rows alone, with cuBLAS' reduced-precision split-K on and off."""
        for small in (4096, 1000, 64):
            for allow in (True, False):
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = allow
                big = torch.nn.functional.linear(x, weight)[:small]
                alone = torch.nn.functional.linear(x[:small], weight)
                results[f"{name}_{x.shape[0]}_vs_{small}_reduced_{allow}"] = _max_diff(big, alone)

    try:
        projection = randn(4 * hidden, hidden, scale=0.02)
        for rows_big in (65536, 16384):
            linear_rows("linear", projection, randn(rows_big, hidden))
        linear_rows(f"linear_k{config.intermediate_size}", randn(hidden, config.intermediate_size, scale=0.02),
                    randn(65536, config.intermediate_size))
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = previous

    if config.num_experts:
        experts, inter, top_k = config.num_experts, config.moe_intermediate_size, config.num_experts_per_tok
        gate_up = randn(experts, 2 * inter, hidden, scale=0.02)
        down = randn(experts, hidden, inter, scale=0.02)
        x = randn(32768, hidden)
        indices = torch.rand(x.shape[0], experts, generator=generator).argsort(dim=1)[:, :top_k].to(device)  # distinct experts per row
        weights = torch.rand(x.shape[0], top_k, generator=generator).to(device=device, dtype=torch.float32)
        big = dispatch.moe_experts(x, indices, weights, gate_up, down)
        for small in (4096, 257):
            alone = dispatch.moe_experts(x[:small], indices[:small], weights[:small], gate_up, down)
            results[f"moe_experts_32768_vs_{small}"] = _max_diff(big[:small], alone)

    heads, head_dim = 4, 192
    # the dense CPU reference attention is quadratic: smaller sequences there (same structure)
    shrink = 1 if device.type == "cuda" else 10
    lengths = [n // shrink for n in (5000, 3000, 700, 6000)]
    total = sum(lengths)
    q, k, v = randn(total, heads, head_dim), randn(total, heads, head_dim), randn(total, heads, 128)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    big = dispatch.attention(q, k, v, cu, cu, scale=head_dim**-0.5)
    start, stop = lengths[0], lengths[0] + lengths[1]
    one = torch.tensor([0, lengths[1]], dtype=torch.int32, device=device)
    alone = dispatch.attention(q[start:stop], k[start:stop], v[start:stop], one, one, scale=head_dim**-0.5)
    results["attention_packed_vs_alone"] = _max_diff(big[start:stop], alone)
    # a branch's queries against ancestor + own keys (HARTS) vs the same rows inside the full sequence (baseline)
    tail = 900 // shrink
    q_tail = q[stop - tail : stop]
    cu_q = torch.tensor([0, tail], dtype=torch.int32, device=device)
    branch = dispatch.attention(q_tail, k[start:stop], v[start:stop], cu_q, one, scale=head_dim**-0.5)
    results["attention_branch_queries_vs_full_sequence"] = _max_diff(alone[-tail:], branch)

    lin_heads, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    lengths = [4100, 1500, 2048, 333]
    total = sum(lengths)
    ql = torch.nn.functional.normalize(randn(total, lin_heads, dk).float(), dim=-1).to(dtype)
    kl = torch.nn.functional.normalize(randn(total, lin_heads, dk).float(), dim=-1).to(dtype)
    vl = randn(total, lin_heads, dv)
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the model's log-decay dtype
    decay = -torch.rand(total, lin_heads, dk, generator=generator).to(device=device, dtype=gate_dtype) * 0.1
    if config.linear != "kda":
        decay = decay[..., 0]
    beta = torch.rand(total, lin_heads, generator=generator).to(device=device, dtype=dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    big, _, _ = dispatch.chunk_linear_attention(ql, kl, vl, decay, beta, cu, chunk_size=chunk, scale=dk**-0.5)
    start, stop = lengths[0], lengths[0] + lengths[1]
    one = torch.tensor([0, lengths[1]], dtype=torch.int32, device=device)
    alone, _, _ = dispatch.chunk_linear_attention(ql[start:stop], kl[start:stop], vl[start:stop], decay[start:stop],
                                                  beta[start:stop], one, chunk_size=chunk, scale=dk**-0.5)
    results["linear_attention_packed_vs_alone"] = _max_diff(big[start:stop], alone)
    return results


@torch.no_grad()
def layer_outputs(model: HybridModel, ids: torch.Tensor, view, parts: bool = True) -> list[torch.Tensor]:
    """Per block, in order: the mixer's output, the FFN's output and the block's output (3 per layer);
    with ``parts=False`` the block's output alone, repeated 3 times (one third of the memory)."""
    outputs: list[torch.Tensor] = []
    linear = linear_rows(view)  # a linear-attention mixer's output rows are the view's linear-attention rows

    def keep(_module, _inputs, out):
        outputs.append((out[0] if isinstance(out, tuple) else out).detach())

    def keep_linear(_module, _inputs, out):
        outputs.append(linear.unpack(out.detach()))

    handles = []
    for layer in model.layers:
        if parts:
            mixer_hook = keep_linear if layer.layer_type == "linear" else keep
            handles += [layer.mixer.register_forward_hook(mixer_hook), layer.mlp.register_forward_hook(keep)]
        handles.append(layer.register_forward_hook(keep))
    try:
        model.forward_hidden(ids, view)
    finally:
        for handle in handles:
            handle.remove()
    return outputs if parts else [h for h in outputs for _ in range(3)]


@torch.no_grad()
def probe_layers(model: HybridModel, batch, plan, groups, trajectories: list[int], parts: bool = True) -> dict:
    """Per block and sub-layer: mean row cosine and max |diff|, baseline vs HARTS and vs repacked; the
    first differing position of every trajectory next to its fork positions."""
    from harts_bench.ablation import fork_positions

    device = model.device
    chunk = plan.chunk_size
    wanted_set = set(trajectories)

    def baseline_rows(group: list[int]) -> dict[int, list[torch.Tensor]]:
        lengths = [len(batch.tokens[i]) for i in group]
        ids = torch.as_tensor(np.concatenate([batch.tokens[i] for i in group]), device=device)
        per_layer = layer_outputs(model, ids, BaselineView(lengths, chunk, device, kernels=dispatch), parts)
        out = {}
        for j, trajectory in enumerate(group):
            if trajectory in wanted_set:
                begin = sum(lengths[:j])
                out[trajectory] = [h[begin : begin + lengths[j]] for h in per_layer]
        return out

    reference: dict[int, list[torch.Tensor]] = {}
    for group in groups:
        if wanted_set.intersection(group):
            reference.update(baseline_rows(group))
    repacked: dict[int, list[torch.Tensor]] = {}
    for trajectory in trajectories[:3]:
        repacked.update(baseline_rows([trajectory]))
    compact: dict[int, list[torch.Tensor]] = {}
    for microbatch in range(len(plan.module.microbatches)):
        layout = plan.layout(microbatch)
        wanted = [j for j, t in enumerate(layout.trajectories) if int(t) in wanted_set]
        if not wanted:
            continue
        view = TreeView(layout, device=device, kernels=dispatch)
        per_layer = layer_outputs(model, view.input_ids(batch.tokens), view, parts)
        for j in wanted:
            rows = torch.as_tensor(layout.trajectory_rows[layout.trajectory_offsets[j] : layout.trajectory_offsets[j + 1]],
                                   device=device)
            compact[int(layout.trajectories[j])] = [h.index_select(0, rows) for h in per_layer]

    forks = fork_positions(plan.module.trie)
    first_difference = {}
    for trajectory in trajectories:
        for index, (a, b) in enumerate(zip(reference[trajectory], compact[trajectory])):
            differs = (a != b).any(dim=-1).nonzero()
            if differs.numel():
                layer, part = divmod(index, 3)
                first_difference[trajectory] = {
                    "layer": layer, "part": ("mixer", "ffn", "block")[part], "position": int(differs[0]),
                    "length": len(batch.tokens[trajectory]), "forks": [int(f) for f in forks[trajectory]]}
                break
    for trajectory, where in first_difference.items():
        say(f"  trajectory {trajectory}: first difference at layer {where['layer']} {where['part']} position "
            f"{where['position']} of {where['length']}; forks at {where['forks'][:8]}")
    say(f"  {len(trajectories) - len(first_difference)} of {len(trajectories)} trajectories are bitwise equal to the baseline")

    table = []
    for index, layer in enumerate(model.layers):
        row = {"layer": index, "kind": f"{layer.layer_type}+{layer.mlp_type}"}
        for name, other in (("harts", compact), ("repacked", repacked)):
            for part in range(3):
                cosines, diffs = [], []
                for trajectory in other:
                    a, b = reference[trajectory][3 * index + part].float(), other[trajectory][3 * index + part].float()
                    cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item())
                    diffs.append(float((a - b).abs().max()))
                suffix = ("_mixer", "_ffn", "")[part]
                row[f"{name}{suffix}_cosine"] = float(np.mean(cosines))
                row[f"{name}{suffix}_max_abs_diff"] = float(np.max(diffs))
        table.append(row)
        say(f"  layer {index:2d} {row['kind']:14s} harts cos {row['harts_cosine']:.8f} max|d| mixer "
            f"{row['harts_mixer_max_abs_diff']:.2e} ffn {row['harts_ffn_max_abs_diff']:.2e} block "
            f"{row['harts_max_abs_diff']:.2e} | repacked cos {row['repacked_cosine']:.8f} mixer "
            f"{row['repacked_mixer_max_abs_diff']:.2e} ffn {row['repacked_ffn_max_abs_diff']:.2e}")
    return {"trajectories": trajectories, "layers": table, "first_difference": first_difference}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ling-3.0-tiny")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=60_000)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target-compression", type=float, default=None,
                        help="the trees harts bench --target-compression would pick (default: trees in order)")
    parser.add_argument("--capacity", type=int, default=harts.DEFAULT_OPTIONS.capacity)
    parser.add_argument("--chunk-size", type=int, default=harts.DEFAULT_OPTIONS.chunk_size)
    parser.add_argument("--trajectories", type=int, default=16, help="trajectories traced through every layer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--blocks-only", action="store_true",
                        help="trace block outputs only (not mixer and FFN separately): a third of the memory")
    parser.add_argument("--out", default="fidelity_probe.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")
    overrides = {"dtype": dtype_name}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    config = HybridConfig.preset(args.preset, **overrides)
    torch.manual_seed(0)
    model = HybridModel(config).to(device)
    model.eval()
    results: dict = {"device": str(device), "torch": torch.__version__, "preset": args.preset,
                     "layers": config.num_layers, "dtype": dtype_name}
    say("operators: row of a big packed batch vs the same row in a small batch (max |diff|)")
    results["ops"] = probe_ops(device, getattr(torch, dtype_name), config, args.chunk_size)
    for name, value in results["ops"].items():
        say(f"  {name}: {value:.3e}")
    full = swe_like_step(seed=args.seed, scale=args.scale, vocab_size=config.vocab_size)
    if args.target_compression is None:
        batch = select_trees(full, args.tokens)
    else:
        batch = trees_near_compression(full, args.tokens, args.target_compression, args.capacity)
    plan = harts.compile(batch, capacity=args.capacity, chunk_size=args.chunk_size)
    groups = baseline_microbatches(batch.lengths, args.capacity)
    trajectories = list(range(min(args.trajectories, len(batch.tokens))))
    say(f"layers: {len(batch.tokens)} trajectories, {batch.semantic_tokens} tokens; tracing {trajectories}")
    results["trace"] = probe_layers(model, batch, plan, groups, trajectories, parts=not args.blocks_only)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    say(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
