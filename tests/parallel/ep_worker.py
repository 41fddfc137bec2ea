"""One rank of the expert-parallel tests (run by tests/parallel/test_expert_parallel.py under torchrun).

    python -m torch.distributed.run --nproc-per-node N tests/parallel/ep_worker.py TP EP DISPATCHERS OUT

DISPATCHERS: comma-separated megatron-core token dispatchers (allgather, alltoall), each run in turn.

The KDA + MLA model with MoE FFNs (4 experts, top-2, expert bias, shared expert) through
megatron-core's ``MoELayer`` at TP x EP, float64 on CPU (float32 on one GPU, TP_WORKER_DEVICE):
per-token log-probs, entropies, q-weighted router statistics and gathered gradients under the
plan and under the trajectory-wise baseline (forks at chunk B-1 / B / B+1), with and without
routed-experts replay, beside the single-process native model; one ``Trainer.step`` per mode
(DP replicas of the plan on megatron's data-parallel ranks) beside a single-process step;
the trained model saved (safetensors and a transformers directory of a Kimi Linear model).
Rank 0 writes the largest differences to OUT/report.json.
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
from harts.parallel.moe import HartsMoELayer  # noqa: E402
from harts.runtime import log_probs  # noqa: E402
from tests.helpers import forked_batch  # noqa: E402
from tests.parallel.tp_worker import (  # noqa: E402
    DEVICE,
    compare_log_probs,
    compare_training,
    dense_model,
    gradient_gap,
    largest,
    prefix_routing,
    surrogate_loss,
)

VARIANT = "kda-mla-moe"
CAPACITY = 40


def main(tensor_parallel: str, expert_parallel: str, dispatchers: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    layout = harts.parallel.initialize(tensor_parallel=int(tensor_parallel), expert_parallel=int(expert_parallel))
    batch = forked_batch(chunk=4)
    alone = [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    report: dict = {"tp": layout.tensor_parallel_size, "ep": layout.expert_parallel_size, "dp": layout.data_parallel_size}
    native = dense_model(VARIANT)
    plan = harts.compile(batch, capacity=60, dp_size=1, chunk_size=4)
    replay = harts.RolloutBatch.from_trajectories(list(batch.tokens), routed_experts=prefix_routing(batch.tokens, native.config))
    replay_plan = harts.compile(replay, capacity=60, dp_size=1, chunk_size=4)
    dispatchers = dispatchers.split(",")
    for dispatcher in dispatchers:  # one launch for several dispatchers: the processes' start-up is most of a run
        parallel = harts.parallel.TensorParallelHybridModel.from_model(dense_model(VARIANT), token_dispatcher=dispatcher)
        moe = [layer.mlp for layer in parallel.layers if isinstance(layer.mlp, HartsMoELayer)]
        report[f"{dispatcher}/local_experts"] = [int(layer.experts.gate_up_proj.shape[0]) for layer in moe]
        report[f"{dispatcher}/class"] = sorted({type(layer.token_dispatcher).__name__ for layer in moe})
        for mode in ("harts", "baseline"):
            report[f"{dispatcher}/{mode}/log_probs"] = compare_log_probs(parallel, native, batch, plan, mode)
            report[f"{dispatcher}/{mode}/replay"] = compare_log_probs(parallel, native, replay, replay_plan, mode)
            checkpoint = str(Path(out, f"trained-{dispatcher}.safetensors")) if mode == "harts" else None
            # capacity 40: the baseline's parts differ in number between the two DP replicas (4 and 3),
            # so the trainer's shadow passes keep the expert-parallel ranks in step
            report[f"{dispatcher}/{mode}/step"] = compare_training(VARIANT, layout, batch, mode, checkpoint, alone,
                                                                   token_dispatcher=dispatcher, capacity=CAPACITY)
        report[f"{dispatcher}/harts/recompute"] = compare_recompute(parallel, native, batch, plan)
    report["baseline_parts"] = baseline_parts(layout, batch, native)
    report["hf_checkpoint_log_probs"] = save_hf_checkpoint(Path(out, "kimi-hf"), batch, plan, dispatchers[0])
    if dist.get_rank() == 0:
        Path(out, "report.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


def compare_recompute(parallel, native, batch, plan) -> dict:
    """Activation checkpointing: the MoE layers' exchanges run again in the backward, on every rank alike."""
    results = []
    for model, recompute in ((parallel, True), (native, False)):
        model.zero_grad(set_to_none=True)
        out = log_probs(model, plan, batch, recompute, with_entropy=True)
        surrogate_loss(out).backward()
        results.append(out.packed.detach())
    return {"log_probs": largest(results[0], results[1]), "gradients": gradient_gap(parallel, native)}


def baseline_parts(layout, batch, model) -> list[int]:
    """How many baseline passes each rank's replica holds (before the trainer's shadow passes)."""
    from harts.runtime.api import bind_plan
    from harts.train.distributed import replica_microbatches
    from harts.train.trainer import _parts

    module = bind_plan(harts.compile(batch, capacity=CAPACITY, dp_size=layout.data_parallel_size, chunk_size=4),
                       batch, model).module
    return [len(_parts(replica_microbatches(module, rank, layout.data_parallel_size), batch, module, "baseline"))
            for rank in range(layout.data_parallel_size)]


def save_hf_checkpoint(directory: Path, batch, plan, dispatcher: str) -> list[float]:
    """A Kimi Linear model (8 experts, group-limited routing, shared expert) split over TP x EP and written
    as a transformers directory by harts.parallel.save_pretrained; returns the split model's log-probs."""
    from harts.models import from_hf
    from tests.helpers.hf import kimi_linear_config

    config = kimi_linear_config(vocab_size=64)
    config.dtype = torch.float64 if DEVICE.type == "cpu" else torch.float32
    torch.manual_seed(2)
    parallel = harts.parallel.TensorParallelHybridModel.from_model(from_hf(config).to(DEVICE), token_dispatcher=dispatcher)
    harts.parallel.save_pretrained(parallel, directory)
    return log_probs(parallel, plan, batch).packed.tolist()


if __name__ == "__main__":
    main(*sys.argv[1:5])
