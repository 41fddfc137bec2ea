"""``harts-bench --tp T --ep E``: the headline workload on harts.parallel's megatron-core path.

Under ``torchrun --nproc-per-node N`` (or alone: a one-process group is made), every rank
builds the preset (MoE layers through megatron-core's MoELayer, experts split over the EP
group, ``--moe-dispatcher`` allgather or alltoall; see harts.parallel.moe), compiles the same plan and times F/B/Grad, as the runtime benchmark does, of:

* ``native``: HARTS on the single-process model (every rank holds it whole);
* ``megatron``: HARTS on this rank's tensor-parallel shard (``TensorParallelHybridModel``);
* ``megatron_baseline_fla``: the trajectory-wise baseline through the same megatron layers,
  linear attention on stock fla.

``native_ratio`` = megatron / native HARTS time (the cost of the megatron layout at TP = 1;
per-rank time at TP > 1), ``cosine`` the cosine of the megatron path's per-token log-probs
against the stock-fla baseline's. Rank 0 prints::

    headline-mcore: tp=1 ep=1 ffn=moe compression=... speedup_vs_fla_baseline=... native_ratio=... cosine=... peak_gib_per_rank=[...]
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from harts_bench.common import say

__all__ = ["megatron_bench"]


def _ensure_process_group(device: torch.device, backend: str | None) -> bool:
    """Join torchrun's group, or make a one-process one; True when this call created it.

    Ranks beyond the GPU count share GPUs round-robin, which only gloo allows (to measure a
    TP = 2 layout's per-rank memory on one GPU, say).
    """
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "nccl" and local_rank >= torch.cuda.device_count():
            raise SystemExit(f"rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible); "
                             "NCCL refuses two ranks on one GPU: pass --dist-backend gloo")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend)
    return True


def _cosine(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    if not keys:
        return float("nan")
    x = torch.cat([a[k].double() for k in keys])
    y = torch.cat([b[k].double() for k in keys])
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


def megatron_bench(args, device: torch.device) -> dict:
    import harts.parallel
    from harts.runtime import HybridModel
    from harts_bench.runtime import (
        StockFla,
        baseline_microbatches,
        baseline_pass,
        build_config,
        build_workload,
        harts_pass,
        measure,
        write_results,
    )
    from harts.kernels import Dispatch

    created = _ensure_process_group(device, getattr(args, "dist_backend", None))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        layout = harts.parallel.initialize(tensor_parallel=args.tp or 1, expert_parallel=args.ep or 1)
        config = build_config(args)
        torch.manual_seed(0)
        with torch.device(device):
            native = HybridModel(config)
        _full, batch, plan, _plan_seconds, _first = build_workload(args, config)
        parallel = harts.parallel.TensorParallelHybridModel.from_model(
            native, token_dispatcher=getattr(args, "moe_dispatcher", "allgather"))
        kernels, stock = Dispatch(args.kernels), StockFla(args.kernels)
        trajectories = len(batch.tokens)
        groups = baseline_microbatches(batch.lengths, args.capacity)
        compact_rows = sum(plan.layout(k).num_rows for k in range(len(plan.module.microbatches)))
        say(f"megatron-core: TP={layout.tensor_parallel_size} EP={layout.expert_parallel_size} DP={layout.data_parallel_size}, "
            f"{config.num_layers} layers ({config.num_moe_layers} MoE), {compact_rows} compact rows")
        ffn = "moe" if config.num_moe_layers else "dense"
        results = {"tp": layout.tensor_parallel_size, "ep": layout.expert_parallel_size, "ffn": ffn,
                   "compression": batch.semantic_tokens / compact_rows}
        results["native"], _ = measure("native harts", lambda collect: harts_pass(native, plan, batch, kernels, trajectories, collect),
                                       native, device, args.warmup, args.repeats)
        native.zero_grad(set_to_none=True)
        results["megatron"], harts_lp = measure(
            "megatron harts", lambda collect: harts_pass(parallel, plan, batch, kernels, trajectories, collect),
            parallel, device, args.warmup, args.repeats)
        parallel.zero_grad(set_to_none=True)
        results["megatron_baseline_fla"], baseline_lp = measure(
            "megatron baseline (stock fla)",
            lambda collect: baseline_pass(parallel, batch, groups, plan.chunk_size, stock, trajectories, collect),
            parallel, device, args.warmup, args.repeats)
        parallel.zero_grad(set_to_none=True)
        results["native_ratio"] = results["megatron"]["mean_seconds"] / results["native"]["mean_seconds"]
        results["speedup_vs_fla_baseline"] = results["megatron_baseline_fla"]["mean_seconds"] / results["megatron"]["mean_seconds"]
        results["cosine"] = _cosine(harts_lp or {}, baseline_lp or {})
        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, results["megatron"]["peak_memory_gib"])
        results["peak_gib_per_rank"] = peaks
        if dist.get_rank() == 0:
            write_results(args.out, results)
            peak_text = "[" + ",".join("nan" if p is None else f"{p:.2f}" for p in peaks) + "]"
            print(f"headline-mcore: tp={results['tp']} ep={results['ep']} ffn={ffn} compression={results['compression']:.4f} "
                  f"speedup_vs_fla_baseline={results['speedup_vs_fla_baseline']:.4f} native_ratio={results['native_ratio']:.4f} "
                  f"cosine={results['cosine']:.8f} peak_gib_per_rank={peak_text}", flush=True)
        return results
    finally:
        if created:
            dist.destroy_process_group()
