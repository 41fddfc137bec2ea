"""Expert parallelism through megatron-core's MoELayer on CPU (gloo, float64), under torchrun.

tests/parallel/ep_worker.py runs on every rank: the KDA + MLA model with MoE FFNs (4 experts,
top-2, expert bias, shared expert) at EP = 2 (2 ranks, the expert-parallel group spanning the
two data-parallel replicas), TP = 2 x EP = 2 (4 ranks) with the all-gather token dispatcher,
and EP = 2 with the all-to-all dispatcher (gloo has all_to_all for CPU tensors), gives the
single-process native model's per-token log-probs, entropies, q-weighted router statistics
and gathered gradients, under the plan and under the trajectory-wise baseline (forks at chunk
B-1 / B / B+1), with and without routed-experts replay; one ``Trainer.step`` (2 epochs,
clipping, aux loss, z-loss, expert-bias updates) moves the weights as a single-process step
does; the trained EP model's checkpoint loads into one process with the same log-probs.
"""

from __future__ import annotations

import json

import pytest
import torch

import harts
from harts.runtime import log_probs
from tests.helpers import REPO, forked_batch
from tests.parallel.test_tensor_parallel import (
    TINY_MODEL,
    assert_transformers_checkpoint_has_log_probs,
    torchrun,
    train_alone_and_under_torchrun,
)

pytest.importorskip("megatron.core")

TOLERANCE = 1e-10
#: (TP, EP, token dispatchers, processes); the all-to-all dispatcher runs in the EP = 2 launch.
LAYOUTS = {"ep2": (1, 2, ("allgather", "alltoall"), 2), "tp2xep2": (2, 2, ("allgather",), 4)}
CASES = [("ep2", "allgather"), ("ep2", "alltoall"), ("tp2xep2", "allgather")]
CLASSES = {"allgather": "RowGatherDispatcher", "alltoall": "RowAllToAllDispatcher"}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return {}


def _launch(name: str, launches: dict, tmp_path_factory) -> tuple[dict, object]:
    """The report and folder of the layout's one torchrun launch (made on first use)."""
    if name not in launches:
        tensor_parallel, expert_parallel, dispatchers, processes = LAYOUTS[name]
        folder = tmp_path_factory.mktemp(name)
        torchrun(processes, str(REPO / "tests" / "parallel" / "ep_worker.py"), str(tensor_parallel), str(expert_parallel),
                 ",".join(dispatchers), str(folder))
        launches[name] = json.loads((folder / "report.json").read_text()), folder
    return launches[name]


@pytest.fixture(params=CASES, ids=[f"{layout}-{dispatcher}" for layout, dispatcher in CASES])
def run(request, launches, tmp_path_factory):
    """(the layout's report with this dispatcher's keys unprefixed, its folder, the dispatcher)."""
    name, dispatcher = request.param
    report, folder = _launch(name, launches, tmp_path_factory)
    mine = {key.removeprefix(f"{dispatcher}/"): value for key, value in report.items()}
    return mine, folder, dispatcher


@pytest.fixture(params=list(LAYOUTS))
def layout_run(request, launches, tmp_path_factory):
    return _launch(request.param, launches, tmp_path_factory)


def test_layout(run):
    report, _, dispatcher = run
    assert (report["tp"], report["ep"]) in ((1, 2), (2, 2)) and report["dp"] == 2
    assert report["local_experts"] == [2, 2]  # 4 experts over EP = 2, in each of the two MoE layers
    assert report["class"] == [CLASSES[dispatcher]]


@pytest.mark.parametrize("key", ["log_probs", "replay"])
@pytest.mark.parametrize("mode", ["harts", "baseline"])
def test_log_probs_statistics_and_gradients_equal_the_single_process_model(run, mode, key):
    """Per-token log-probs and entropies, the router's q-weighted sums (z-loss sum, probability mass,
    assignment counts, tokens) and every gathered gradient (experts from their EP ranks), with and without replay."""
    found = run[0][f"{mode}/{key}"]
    assert found["rows"] == (117 if mode == "harts" else 214)
    assert max(value for name, value in found.items() if name != "rows") < TOLERANCE, found


def test_activation_checkpointing_reruns_the_exchanges_alike(run):
    """recompute=True: every MoE layer's dispatch runs again in the backward; log-probs and gradients unchanged."""
    found = run[0]["harts/recompute"]
    assert found["log_probs"] < TOLERANCE and found["gradients"] < TOLERANCE, found


@pytest.mark.parametrize("mode", ["harts", "baseline"])
def test_a_trainer_step_equals_the_single_process_step(run, mode):
    found = run[0][f"{mode}/step"]
    assert found["moved"] > 1e-4
    for key in ("loss", "grad_norm", "entropy", "z_loss", "load_balancing_loss", "weights"):
        assert found[key] < TOLERANCE, key


def test_the_baseline_step_needed_shadow_passes(layout_run):
    """The two replicas hold different numbers of baseline passes: the steps above kept the
    expert-parallel ranks in step with shadow passes (else the MoE exchange would hang)."""
    parts = layout_run[0]["baseline_parts"]
    assert len(set(parts)) == 2, parts


def test_an_expert_parallel_checkpoint_loads_into_one_process(run):
    from safetensors.torch import load_file

    from tests.parallel.tp_worker import dense_model

    report, folder, dispatcher = run
    model = dense_model("kda-mla-moe")
    model.load_state_dict(load_file(folder / f"trained-{dispatcher}.safetensors"))
    batch = forked_batch(chunk=4)
    plan = harts.compile(batch, capacity=40, dp_size=1, chunk_size=4)
    want = torch.tensor(report["harts/step"]["checkpoint_log_probs"], dtype=torch.float64)
    got = log_probs(model, plan, batch).packed.detach()
    assert float((got - want).abs().max()) < TOLERANCE
    assert float((got - log_probs(dense_model("kda-mla-moe"), plan, batch).packed.detach()).abs().max()) > 1e-6


def test_an_expert_parallel_model_saves_a_transformers_checkpoint(layout_run):
    """Kimi Linear (8 experts over EP, group-limited routing, shared expert): harts.parallel.save_pretrained
    gathers the experts; the directory loads in one process with the split model's log-probs."""
    report, folder = layout_run
    assert_transformers_checkpoint_has_log_probs(folder / "kimi-hf", report["hf_checkpoint_log_probs"])


def test_harts_train_under_torchrun_with_ep_trains_as_one_process(tmp_path):
    """`torchrun -m harts train --ep 2` (a MoE model, AdamW, 2 steps) equals a single-process run."""
    model = dict(TINY_MODEL, ffn="moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    records, weights = train_alone_and_under_torchrun(tmp_path, model, ["--ep", "2", "--moe-dispatcher", "alltoall"],
                                                      aux_loss_coef=1e-2)
    assert len(records[0]) == len(records[1]) == 2 * 2  # steps x epochs
    for want, got in zip(*records):
        for key in ("loss", "load_balancing_loss", "z_loss"):
            assert abs(got[key] - want[key]) < TOLERANCE, key
    assert weights[0].keys() == weights[1].keys()
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < TOLERANCE
