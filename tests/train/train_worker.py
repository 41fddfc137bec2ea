"""One rank of the data-parallel tests (run by tests/train/test_train_distributed.py under torchrun).

    python -m torch.distributed.run --nproc-per-node 2 tests/train/train_worker.py TABLE CONFIG OUT

Trains with the `harts train` loop under DDP and then under FSDP2 (weights to
OUT/{ddp,fsdp}.safetensors), checks that an unwrapped model and a plan of another DP degree
are refused, and writes each rank's metrics to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import harts
from harts.train import Trainer, TrainingError
from harts.train.loop import build_model, load_options, run_training
from harts.rollouts.inputs import resolve_input


def refused(call) -> str:
    try:
        call()
    except TrainingError as error:
        return str(error)
    return ""


def main(table: str, config: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict = {"world_size": dist.get_world_size()}
    for parallel in ("ddp", "fsdp"):
        options = load_options({"input": table, "parallel": parallel, "save": str(Path(out) / f"{parallel}.safetensors")}, config)
        run = run_training(options, progress=False)
        report[parallel] = list(run.records)
        report["num_microbatches"] = run.plan_stats["num_microbatches"]

    batch = resolve_input(table)
    model = build_model(options, batch)
    plan = harts.compile(batch, capacity=options.capacity, dp_size=dist.get_world_size(), chunk_size=options.chunk_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report["unwrapped"] = refused(lambda: Trainer(model, optimizer).step(batch, plan))
    single = harts.compile(batch, capacity=options.capacity, dp_size=1, chunk_size=options.chunk_size)
    wrapped = DistributedDataParallel(model)
    report["dp_mismatch"] = refused(lambda: Trainer(wrapped, optimizer).step(batch, single))
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
