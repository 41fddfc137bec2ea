"""Data parallelism under torchrun (gloo, CPU): D ranks train exactly as one process (§3.2, §4.3).

Each rank runs the microbatches the plan assigns to its replica, slot by slot; DDP or FSDP2
reduces the gradients once per optimizer step. With global loss denominators and
all-reduced expert loads, the per-step losses and the final weights equal a single-process
run's (float64, 1e-9), although that run uses a plan of another DP degree and microbatching.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

import harts
from harts.cli import app
from tests.helpers import SMALL_MODEL, forked_batch, max_relative_difference
from tests.helpers import REPO

ROOT = REPO
runner = CliRunner()


def torchrun(processes: int, *arguments: str, timeout: float = 240) -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *arguments]
    completed = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dp")
    table = folder / "rollouts.jsonl"
    forked_batch().write(table)
    config = folder / "run.yaml"
    config.write_text(yaml.safe_dump(dict(steps=3, epochs=2, dtype="float64", chunk_size=4, capacity=40, lr=3e-3,
                                          aux_loss_coef=1e-2, z_loss_coef=1e-3, seed=1, model=SMALL_MODEL)))
    return folder, table, config


def single_process(folder: Path, table: Path, config: Path, capacity: int) -> tuple[list[dict], dict]:
    metrics, weights = folder / f"single-{capacity}.jsonl", folder / f"single-{capacity}.safetensors"
    if not metrics.exists():
        result = runner.invoke(app, ["train", str(table), "--config", str(config), "--capacity", str(capacity),
                                     "--metrics", str(metrics), "--save", str(weights)])
        assert result.exit_code == 0, result.output
    return [json.loads(line) for line in metrics.read_text().splitlines()], load_file(weights)


def assert_same_training(records: list[dict], weights: dict, reference: tuple[list[dict], dict]) -> None:
    want_records, want_weights = reference
    assert len(records) == len(want_records) == 6
    for got, want in zip(records, want_records):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9)
        assert got["tokens"] == want["tokens"] and got["semantic_tokens"] == want["semantic_tokens"]
        assert got["kl"] == pytest.approx(want["kl"], rel=1e-9, abs=1e-15)
        if got["epoch"] == 1:
            assert got["ratio_min"] == got["ratio_max"] == 1.0
    assert max_relative_difference(weights, want_weights) <= 1e-9


def test_two_ranks_under_ddp_and_fsdp2_train_as_one_process(workload):
    folder, table, config = workload
    out = folder / "two"
    out.mkdir()
    torchrun(2, str(ROOT / "tests" / "train" / "train_worker.py"), str(table), str(config), str(out))
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    reference = single_process(folder, table, config, capacity=200)
    # the single process runs a plan of another microbatching: fewer, larger microbatches
    assert harts.compile(forked_batch(), capacity=200, chunk_size=4).stats["num_microbatches"] < reports[0]["num_microbatches"]
    for parallel in ("ddp", "fsdp"):
        assert reports[0][parallel] == reports[1][parallel]  # metrics are global: every rank reports the same
        assert_same_training(reports[0][parallel], load_file(out / f"{parallel}.safetensors"), reference)
    assert "the model is not wrapped" in reports[0]["unwrapped"]
    assert "compiled for 1 data-parallel replica(s)" in reports[0]["dp_mismatch"] and "2 rank(s)" in reports[0]["dp_mismatch"]


def test_four_ranks_of_harts_train_under_torchrun_train_as_one_process(workload):
    folder, table, config = workload
    metrics, weights = folder / "four.jsonl", folder / "four.safetensors"
    torchrun(4, "-m", "harts", "train", str(table), "--config", str(config), "--metrics", str(metrics), "--save", str(weights))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # rank 0 alone writes
    assert_same_training(records, load_file(weights), single_process(folder, table, config, capacity=200))
