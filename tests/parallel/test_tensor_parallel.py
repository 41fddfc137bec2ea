"""megatron-core tensor + sequence parallelism on CPU (gloo, float64), under torchrun.

tests/parallel/tp_worker.py runs on every rank: the hybrid model (KDA + MLA, GDN + GQA, and
KDA + MLA with MoE FFNs, expert bias and router replay) split over TP ranks gives the single-process native model's per-token log-probs,
entropies and gathered gradients, under the compiled plan and under the trajectory-wise
baseline (forks at chunk B-1 / B / B+1); one ``Trainer.step`` (2 epochs, clipping, entropy
bonus, temperature) moves the weights as a single-process step does, at TP = 2 and at
TP = 2 x DP = 2; the vocab-parallel log-prob head equals the full-vocabulary one, forward and
backward; a TP = 2 checkpoint loads into a single-process model with the same log-probs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import harts
from harts.runtime import log_probs
from tests.helpers import REPO, forked_batch

pytest.importorskip("megatron.core")

TOLERANCE = 1e-10


def torchrun(processes: int, *arguments: str, timeout: float = 600) -> None:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *arguments]
    completed = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"


#: The tiny KDA + MLA model of the `harts train` runs below (each test adds its FFN).
TINY_MODEL = dict(hidden_size=32, num_layers=2, layer_types=["linear", "full"], linear_num_key_heads=2,
                  linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_attention_heads=2,
                  head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def train_alone_and_under_torchrun(tmp_path, model: dict, parallel_flags: list[str], **run) -> tuple[list, list]:
    """`harts train` of a forked rollout table, 2 steps from one YAML config (``run`` added to it), in one
    process and under `torchrun` (2 processes) with ``parallel_flags``: (the two runs' metrics records,
    their saved weights)."""
    import yaml
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from harts.cli import app

    table, config = tmp_path / "rollouts.jsonl", tmp_path / "run.yaml"
    forked_batch().write(table)
    config.write_text(yaml.safe_dump(dict(steps=2, dtype="float64", chunk_size=4, capacity=60, lr=3e-3, seed=1, **run,
                                          model=model)))
    single = CliRunner().invoke(app, ["train", str(table), "--config", str(config), "--metrics", str(tmp_path / "one.jsonl"),
                                      "--save", str(tmp_path / "one.safetensors")])
    assert single.exit_code == 0, single.output
    torchrun(2, "-m", "harts", "train", str(table), "--config", str(config), *parallel_flags,
             "--metrics", str(tmp_path / "many.jsonl"), "--save", str(tmp_path / "many.safetensors"))
    records = [[json.loads(line) for line in (tmp_path / name).read_text().splitlines()] for name in ("one.jsonl", "many.jsonl")]
    weights = [load_file(tmp_path / name) for name in ("one.safetensors", "many.safetensors")]
    return records, weights


def assert_transformers_checkpoint_has_log_probs(directory, want) -> None:
    """The transformers directory ``directory`` loads in one process with the log-probs ``want`` on the forked batch."""
    from harts.models import from_hf

    model = from_hf(str(directory), dtype="float64")
    batch = forked_batch(chunk=4)
    plan = harts.compile(batch, capacity=60, dp_size=1, chunk_size=4)
    want = torch.tensor(want, dtype=torch.float64)
    assert float((log_probs(model, plan, batch).packed.detach() - want).abs().max()) < TOLERANCE


@pytest.fixture(scope="module", params=[(1, 1), (2, 2), (2, 4)], ids=["tp1", "tp2", "tp2xdp2"])
def run(request, tmp_path_factory):
    tensor_parallel, processes = request.param
    folder = tmp_path_factory.mktemp(f"tp{tensor_parallel}-{processes}")
    checkpoint = folder / "trained.safetensors"
    torchrun(processes, str(REPO / "tests" / "parallel" / "tp_worker.py"), str(tensor_parallel), str(folder), str(checkpoint))
    return json.loads((folder / "report.json").read_text()), checkpoint


def test_layout(run):
    report, _ = run
    assert report["tp"] * report["dp"] in (1, 2, 4)


VARIANTS = ["kda-mla", "gdn-gqa", "kda-mla-moe"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["harts", "baseline"])
def test_log_probs_and_gradients_equal_the_single_process_model(run, variant, mode):
    found = run[0][f"{variant}/{mode}/log_probs"]
    assert found["log_probs"] < TOLERANCE and found["entropy"] < TOLERANCE
    assert found["log_probs_vs_baseline"] < TOLERANCE
    assert found["gradients"] < TOLERANCE
    assert found["rows"] == (117 if mode == "harts" else 214)  # the plan runs compact rows, the baseline every token


@pytest.mark.parametrize("mode", ["harts", "baseline"])
@pytest.mark.parametrize("key", ["log_probs", "replay"])
def test_moe_statistics_equal_the_single_process_model(run, mode, key):
    """megatron-core's MoELayer with all experts on every rank (EP = 1), each rank routing its rows: the q-weighted router statistics
    (z-loss sum, probability mass, assignment counts, tokens) are the whole batch's, with and without router replay."""
    found = run[0][f"kda-mla-moe/{mode}/{key}"]
    assert max(value for name, value in found.items() if name != "rows") < TOLERANCE, found


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mode", ["harts", "baseline"])
def test_a_trainer_step_equals_the_single_process_step(run, variant, mode):
    found = run[0][f"{variant}/{mode}/step"]
    assert found["moved"] > 1e-4  # the step changed the weights
    for key in ("loss", "grad_norm", "entropy", "weights"):
        assert found[key] < TOLERANCE, key


def test_random_rollout_trees_equal_the_single_process_model(run):
    """hypothesis trees (forks before, on and after chunk boundaries; prefixes; microbatch capacity varied), drawn alike on every rank."""
    found = dict(run[0]["random_trees"])
    assert found.pop("examples") == 8
    assert max(found.values()) < TOLERANCE, found


def test_vocab_parallel_log_probs_and_entropy_equal_the_full_vocabulary(run):
    found = run[0]["vocab_parallel"]
    assert max(found.values()) < TOLERANCE, found


def test_a_tensor_parallel_checkpoint_loads_into_one_process(run):
    report, checkpoint = run
    from safetensors.torch import load_file

    from tests.parallel.tp_worker import dense_model

    model = dense_model("kda-mla")
    model.load_state_dict(load_file(checkpoint))
    batch = forked_batch(chunk=4)
    plan = harts.compile(batch, capacity=60, dp_size=1, chunk_size=4)
    want = torch.tensor(report["kda-mla/harts/step"]["checkpoint_log_probs"], dtype=torch.float64)
    got = log_probs(model, plan, batch).packed.detach()
    assert float((got - want).abs().max()) < TOLERANCE
    assert float((got - log_probs(dense_model("kda-mla"), plan, batch).packed.detach()).abs().max()) > 1e-6  # trained


def test_a_tensor_parallel_model_saves_a_transformers_checkpoint(run):
    """harts.parallel.save_pretrained gathers the shards (Kimi Linear: MLA, MoE, shared expert); loading the
    directory back in one process gives the sharded model's log-probs."""
    report, checkpoint = run
    directory = checkpoint.parent / "kimi-hf"
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert_transformers_checkpoint_has_log_probs(directory, report["hf_checkpoint_log_probs"])


def test_harts_train_under_torchrun_with_tp_trains_as_one_process(tmp_path):
    """`torchrun -m harts train --tp 2` (AdamW, KL to the initial weights, 2 epochs) equals a single-process run."""
    records, weights = train_alone_and_under_torchrun(tmp_path, dict(TINY_MODEL, ffn="dense", intermediate_size=48), ["--tp", "2"])
    assert len(records[0]) == len(records[1]) == 4
    for want, got in zip(*records):
        assert abs(got["loss"] - want["loss"]) < TOLERANCE and abs(got["kl"] - want["kl"]) < TOLERANCE
    assert weights[0].keys() == weights[1].keys()
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < TOLERANCE
