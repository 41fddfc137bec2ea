"""TP = 1 megatron path vs the native GPU path (run by tests/parallel/test_tensor_parallel_gpu.py, one process, NCCL).

    python -m torch.distributed.run --nproc-per-node 1 tests/parallel/gpu_worker.py OUT

A bf16 dense model (KDA + MLA, GDN + GQA) on the fast kernels: per-token log-probs of the
plan and of the baseline from both paths (``bitwise``: torch.equal), and the cosine and
largest relative difference of their parameter gradients. Writes OUT/report.json.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

import harts  # noqa: E402
import harts.parallel  # noqa: E402
from harts.runtime import HybridConfig, HybridModel, log_probs, log_probs_baseline  # noqa: E402
from tests.helpers import forked_batch  # noqa: E402


def model(variant: str) -> HybridModel:
    torch.manual_seed(0)
    extra = dict(linear="kda", attention="mla") if variant == "kda-mla" else dict(linear="gdn", attention="gqa")
    config = HybridConfig.preset("tiny", ffn="dense", dtype="bfloat16", vocab_size=512, **extra)
    return HybridModel(config).cuda()


def gradients(network) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in network.parameters() if p.grad is not None])


def main(out: str) -> None:
    dist.init_process_group("nccl")
    harts.parallel.initialize(tensor_parallel=1)
    batch = forked_batch(chunk=64)
    plan = harts.compile(batch, capacity=4096, chunk_size=64)
    report = {}
    for variant in ("kda-mla", "gdn-gqa"):
        native = model(variant)
        parallel = harts.parallel.TensorParallelHybridModel.from_model(model(variant))
        for mode in ("harts", "baseline"):
            results = []
            for network in (native, parallel):
                network.zero_grad(set_to_none=True)
                out_ = log_probs(network, plan, batch) if mode == "harts" else log_probs_baseline(network, batch, microbatches=plan)
                out_.packed.sum().backward()
                results.append((out_.packed.detach(), gradients(network)))
            (lp_a, g_a), (lp_b, g_b) = results
            report[f"{variant}/{mode}"] = {
                "bitwise": bool(torch.equal(lp_a, lp_b)),
                "log_prob_max_difference": float((lp_a - lp_b).abs().max()),
                "gradient_cosine": float(torch.nn.functional.cosine_similarity(g_a, g_b, dim=0)),
                "gradient_relative_difference": float((g_a - g_b).norm() / g_a.norm()),
            }
    Path(out, "report.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
