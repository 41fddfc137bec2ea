"""One rank of the megatron-core data-parallel tests (harts.parallel.optim), under torchrun.

    python -m torch.distributed.run --nproc-per-node N tests/parallel/mdp_worker.py MODE TP OUT

MODE ``replicas`` (CPU, gloo, float64; run by tests/parallel/test_megatron_ddp.py): the parameters
harts.parallel.optim marks for ``finalize_model_grads``' tensor-parallel sum are those HARTS' own
``finalize_gradients`` sums, and megatron-core's sum over them (the code ``finalize_model_grads`` runs,
``_allreduce_non_tensor_model_parallel_grads``) gives HARTS' gradients, which gather to the
single-process model's: nothing is counted twice or missed.

MODE ``compare`` (CUDA, float32; run by tests/parallel/test_megatron_ddp_gpu.py): two ``Trainer.step``
runs (2 epochs each, clipping, weight decay) of the same TP x DP layout, one with torch DDP + torch
AdamW, one with megatron-core's DDP + distributed optimizer; the largest differences of losses,
gradient norms, old log-probs, weights and a checkpoint written from the megatron-wrapped model.
NCCL with one GPU per rank when there are enough GPUs, else gloo with every rank on cuda:0.

Rank 0 writes OUT/report.json.
"""

from __future__ import annotations

import json
import os
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

MODE = sys.argv[1]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if MODE == "compare":
    NCCL = torch.cuda.device_count() >= WORLD and os.environ.get("HARTS_MDP_BACKEND", "nccl") == "nccl"
    os.environ["TP_WORKER_DEVICE"] = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if NCCL else "cuda:0"

import harts  # noqa: E402
import harts.parallel  # noqa: E402
from harts.parallel.optim import ddp_config, mark_tensor_parallel_replicas, megatron_optimizer, transformer_config, wrap_megatron  # noqa: E402
from harts.runtime import log_probs  # noqa: E402
from harts.train import TrainConfig, Trainer  # noqa: E402
from harts.train.loop import save_weights  # noqa: E402
from tests.helpers import forked_batch  # noqa: E402
from tests.parallel.tp_worker import DEVICE, dense_model, largest, surrogate_loss  # noqa: E402


def replicas(layout) -> dict:
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    batch = forked_batch(chunk=4)
    plan = harts.compile(batch, capacity=60, dp_size=1, chunk_size=4)
    report = {}
    for variant in ("kda-mla", "kda-mla-moe"):
        native = dense_model(variant)
        surrogate_loss(log_probs(native, plan, batch, with_entropy=True)).backward()
        ours, theirs = (harts.parallel.TensorParallelHybridModel.from_model(dense_model(variant)) for _ in range(2))
        for model in (ours, theirs):
            surrogate_loss(log_probs(model, plan, batch, with_entropy=True)).backward()
        ours.finalize_gradients()
        marked = mark_tensor_parallel_replicas(theirs)
        config = transformer_config(theirs)
        # what finalize_model_grads hands its TP sum: the DDP-wrapped chunk (its ddp_config; the module's parameters)
        chunk = types.SimpleNamespace(ddp_config=ddp_config(), module=theirs)
        _allreduce_non_tensor_model_parallel_grads([chunk], config, layout.tensor_parallel_group)
        gathered = theirs.full_gradients()
        report[variant] = {
            "marked": sorted(marked),
            # what finalize_gradients sums over TP: replicated, not an expert (those go over expert-DP)
            "replicated": sorted(name for name, dim in ours.split_dims.items() if dim is None
                                 and name in dict(ours.native_named_parameters()) and name not in ours.expert_names),
            "sequence_parallel": config.sequence_parallel,
            "tensor_model_parallel_size": config.tensor_model_parallel_size,
            # experts (allreduce=False) are reduced by megatron's DDP buffers over the expert-data-parallel
            # group, which need CUDA (test_megatron_ddp_gpu.py); finalize_model_grads' TP sum covers the rest
            "megatron_vs_harts": max(float((p.grad - q.grad).abs().max())
                                     for (name, p), q in zip(theirs.native_named_parameters(), ours.parameters())
                                     if name not in theirs.expert_names),
            "megatron_vs_single_process": max(largest(gathered[name], p.grad) for name, p in native.named_parameters()
                                              if name not in theirs.expert_names),
        }
    return report


OPTIMIZER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def trainers(variant, layout, config):
    """(torch DDP + AdamW, megatron DDP + distributed optimizer) trainers and their TP models, same start weights."""
    from torch.nn.parallel import DistributedDataParallel

    torch_model = harts.parallel.TensorParallelHybridModel.from_model(dense_model(variant))
    wrapped = torch_model
    if layout.data_parallel_size > 1:
        device_ids = [DEVICE.index] if NCCL else None
        wrapped = DistributedDataParallel(torch_model, device_ids=device_ids, process_group=layout.data_parallel_group)
    torch_trainer = Trainer(wrapped, torch.optim.AdamW(torch_model.parameters(), **OPTIMIZER), config,
                            process_group=layout.data_parallel_group)
    megatron_model = harts.parallel.TensorParallelHybridModel.from_model(dense_model(variant))
    megatron_wrapped = wrap_megatron(megatron_model)
    optimizer = megatron_optimizer(megatron_wrapped, max_grad_norm=config.max_grad_norm, **OPTIMIZER)
    megatron_trainer = Trainer(megatron_wrapped, optimizer, config, process_group=layout.data_parallel_group)
    return (torch_trainer, torch_model), (megatron_trainer, megatron_model)


def compare(layout, out: str) -> dict:
    batch = forked_batch(chunk=4)
    plan = harts.compile(batch, capacity=60, dp_size=layout.data_parallel_size, chunk_size=4)
    single = harts.compile(batch, capacity=60, dp_size=1, chunk_size=4)
    config = TrainConfig(epochs=2, max_grad_norm=0.5, with_entropy=True, entropy_coef=0.01, temperature=0.9)
    report = {"tp": layout.tensor_parallel_size, "dp": layout.data_parallel_size, "nccl": NCCL}
    for variant in ("kda-mla",):  # one dense model keeps the run short (its Triton kernels compile once)
        (torch_trainer, torch_model), (megatron_trainer, megatron_model) = trainers(variant, layout, config)
        start = torch_model.full_state_dict()
        for step in (1, 2):
            want, got = torch_trainer.step(batch, plan), megatron_trainer.step(batch, plan)
            found = {key: max(abs(a[key] - b[key]) / max(1.0, abs(b[key])) for a, b in zip(got.metrics, want.metrics))
                     for key in ("loss", "grad_norm", "entropy", "policy_loss")}
            found["old_log_probs"] = max(largest(got.old_log_probs[k], want.old_log_probs[k]) for k in want.old_log_probs)
            found["same_microbatches"] = sorted(got.old_log_probs) == sorted(want.old_log_probs)
            weights, reference = megatron_model.full_state_dict(), torch_model.full_state_dict()
            found["weights"] = max(largest(weights[name], reference[name]) for name in reference)
            found["moved"] = max(largest(reference[name], start[name]) for name in reference)
            found["clipped"] = max(record["grad_norm"] for record in want.metrics) > config.max_grad_norm
            report[f"{variant}/step{step}"] = found
        after = log_probs(megatron_trainer.model, single, batch).packed.detach()  # through megatron DDP's forward
        report[f"{variant}/log_probs"] = largest(after, log_probs(torch_model, single, batch).packed.detach())
        checkpoint = Path(out, f"{variant}.safetensors")
        save_weights(megatron_trainer.model, checkpoint, rank=dist.get_rank())  # unwraps megatron DDP
        dist.barrier()
        from safetensors.torch import load_file

        native = dense_model(variant)
        native.load_state_dict({k: v.to(DEVICE) for k, v in load_file(checkpoint).items()})
        report[f"{variant}/checkpoint_log_probs"] = largest(log_probs(native, single, batch).packed.detach(), after)
    return report


def main(mode: str, tensor_parallel: str, out: str) -> None:
    if mode == "compare":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if mode == "compare" and NCCL else "gloo")
    torch.set_num_threads(1)
    layout = harts.parallel.initialize(tensor_parallel=int(tensor_parallel))
    report = replicas(layout) if mode == "replicas" else compare(layout, out)
    if dist.get_rank() == 0:
        Path(out, "report.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
