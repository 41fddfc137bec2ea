"""The step API and `harts train`: HARTS trains exactly as the trajectory-wise baseline (§3.5, §4.1).

Float64 throughout: per-step losses agree to 1e-9 relative and parameters to 1e-9 after the
last step; old-log-prob ratios are exactly 1 in each step's first epoch; the loss does not
depend on how the batch is cut into microbatches (global denominators); data-parallel
wrappers are accepted by the runtime and the trainer.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

import harts
from harts.cli import app
from harts.rl import grpo_loss, loss_denominator, policy_loss
from harts.runtime import log_probs, log_probs_baseline
from harts.runtime.moe import TopKRouter
from harts.train import TrainConfig, Trainer, TrainingError, replica_microbatches
from harts.train.loop import load_options
from tests.helpers import token_trees
from tests.helpers import make_plan, tiny_model
from tests.helpers import SMALL_MODEL, forked_batch, max_relative_difference, rl_batch

pytestmark = pytest.mark.usefixtures("single_thread")

runner = CliRunner()


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(model, batch, plan, mode, steps=2, reference=None, **config):
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = Trainer(model, optimizer, TrainConfig(mode=mode, **config), reference_model=reference)
    return [record for _ in range(steps) for record in trainer.step(batch, plan).metrics]


# ----------------------------------------------------------------------------- harts.rl


def test_grpo_loss_takes_old_log_probs_in_the_runtime_layout():
    batch = forked_batch()
    plan = harts.compile(batch, capacity=10_000, chunk_size=4)
    model = tiny_model()
    out = log_probs(model, plan, batch)
    old = [lp.detach() - 0.01 * torch.arange(lp.shape[0], dtype=lp.dtype) for lp in out.log_probs]
    padded = [torch.cat([lp.new_zeros(1), lp]) for lp in old]  # the token-aligned layout (a dummy entry 0)
    want = grpo_loss(out, batch, old_log_probs=padded).loss
    for layout in (old, torch.cat(old)):
        torch.testing.assert_close(grpo_loss(out, batch, old_log_probs=layout).loss, want, rtol=0, atol=0)
    # the runtime's output object itself: the ratio is exactly 1
    on_policy = grpo_loss(out, batch, old_log_probs=log_probs(model, plan, batch), ref_log_probs=out)
    assert on_policy.metrics["ratio_mean"] == 1.0 and on_policy.metrics["clip_fraction"] == 0.0
    assert on_policy.metrics["kl"] == 0.0
    with pytest.raises(harts.RolloutInputError, match="trajectory 0: field 'old_log_probs' has 5 entries"):
        grpo_loss(out, batch, old_log_probs=[torch.zeros(5)] + old[1:])


@settings(max_examples=20, deadline=None)
@given(trajectories=token_trees(chunk_size=4, max_trajectories=8, max_length=16), seed=st.integers(0, 2**16),
       reduction=st.sampled_from(["token-mean", "seq-mean", "seq-mean-token-sum", "sum"]), data=st.data())
def test_microbatch_shares_with_global_denominators_sum_to_the_batch_loss(trajectories, seed, reduction, data):
    rng = np.random.default_rng(seed)
    values = [torch.tensor(-rng.random(len(t) - 1) * 3, dtype=torch.float64) for t in trajectories]
    masks = [(rng.random(len(t)) < 0.6).astype(np.float64) for t in trajectories]
    advantages, old = rng.normal(size=len(trajectories)), [-rng.random(len(t)) * 3 for t in trajectories]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(t) - 1 for t in trajectories])]))
    denominator = loss_denominator(masks, offsets, reduction)
    whole = policy_loss(values, advantages=advantages, loss_mask=masks, old_log_probs=old, reduction=reduction).loss
    groups = data.draw(st.lists(st.integers(0, 2), min_size=len(trajectories), max_size=len(trajectories)))
    shares = 0.0
    for group in set(groups):
        members = [i for i, g in enumerate(groups) if g == group]
        shares = shares + policy_loss(
            [values[i] for i in members], advantages=advantages[members], loss_mask=[masks[i] for i in members],
            old_log_probs=[old[i] for i in members], reduction=reduction, denominator=denominator,
        ).loss
    torch.testing.assert_close(torch.as_tensor(shares, dtype=torch.float64), whole, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- runtime entry points


def test_temperature_divides_the_logits_before_the_log_softmax():
    batch = forked_batch()
    plan = harts.compile(batch, capacity=10_000, chunk_size=4)
    model = tiny_model()
    temperature = 0.7
    out = log_probs(model, plan, batch, temperature=temperature, with_entropy=True)
    ref = log_probs_baseline(model, batch, microbatches=plan, temperature=temperature, with_entropy=True)
    torch.testing.assert_close(out.packed, ref.packed, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.packed_entropy, ref.packed_entropy, rtol=0, atol=1e-12)
    for i, tokens in enumerate(batch.tokens):  # the definition, from full logits of one trajectory
        from harts.runtime import BaselineView

        ids = torch.tensor(tokens)
        logits, _ = model(ids, BaselineView([len(tokens)], 4))
        expected = torch.log_softmax(logits / temperature, dim=-1)[:-1].gather(1, ids[1:, None])[:, 0]
        torch.testing.assert_close(out.log_probs[i], expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        log_probs(model, plan, batch, temperature=0.0)


# ----------------------------------------------------------------------------- the step API


@settings(max_examples=8, deadline=None)
@given(trajectories=token_trees(chunk_size=4, max_trajectories=7, max_length=18), data=st.data(),
       model=st.sampled_from([("kda", "mla", "moe"), ("gdn", "gqa", "dense"), ("kda", "mha", "dense")]))
def test_harts_on_any_microbatching_trains_as_the_baseline_on_one(trajectories, data, model):
    """HARTS on a random split into microbatches == the baseline on the whole batch at once, step by step."""
    assume(any(len(t) > 2 for t in trajectories))  # rl_batch masks out the first two tokens; a batch training nothing is refused
    batch = rl_batch(trajectories, seed=len(trajectories))
    assignment = data.draw(st.lists(st.integers(0, 2), min_size=len(trajectories), max_size=len(trajectories)))
    groups = [g for g in ([i for i, a in enumerate(assignment) if a == k] for k in range(3)) if g]
    reduction = data.draw(st.sampled_from(["token-mean", "seq-mean"]))
    options = dict(epochs=2, reduction=reduction, z_loss_coef=1e-2, aux_loss_coef=1e-2, expert_bias_rate=1e-3, entropy_coef=1e-3)
    start = copy.deepcopy(tiny_model(*model))
    harts_model, baseline_model = copy.deepcopy(start), copy.deepcopy(start)
    got = train(harts_model, batch, make_plan(batch, 4, groups), "harts", **options)
    want = train(baseline_model, batch, make_plan(batch, 4, [list(range(len(trajectories)))]), "baseline", **options)
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9, abs=1e-12)
        assert a["tokens"] == b["tokens"]
    assert max_relative_difference(state(harts_model), state(baseline_model)) <= 1e-9


def test_the_baseline_runs_a_microbatch_in_parts_of_at_most_the_capacity_and_trains_as_harts(monkeypatch):
    """A microbatch holds up to ``capacity`` compact rows, so expanded it holds more raw tokens: the
    baseline runs it as consecutive parts of at most ``capacity`` raw tokens and accumulates them."""
    import harts.train.trainer as trainer_module

    batch = forked_batch()
    capacity = 60
    plan = harts.compile(batch, capacity=capacity, chunk_size=4)
    assert any(sum(len(batch.tokens[i]) for i in mb.trajectories) > capacity for mb in plan.module.microbatches)
    calls = []
    run_part = trainer_module.microbatch_log_probs_baseline

    def recording(model, batch, trajectories, **options):
        calls.append(tuple(trajectories))
        return run_part(model, batch, trajectories, **options)

    monkeypatch.setattr(trainer_module, "microbatch_log_probs_baseline", recording)
    options = dict(epochs=2, z_loss_coef=1e-2, aux_loss_coef=1e-2, expert_bias_rate=1e-3)
    start = tiny_model()
    harts_model, baseline_model = copy.deepcopy(start), copy.deepcopy(start)
    results = {}
    for mode, model in (("harts", harts_model), ("baseline", baseline_model)):
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), TrainConfig(mode=mode, **options))
        results[mode] = trainer.step(batch, plan)
    assert calls and all(len(part) == 1 or sum(len(batch.tokens[i]) for i in part) <= capacity for part in calls)
    members = sorted(i for mb in plan.module.microbatches for i in mb.trajectories)
    passes = 1 + options["epochs"]  # old log-probs, then every epoch
    assert len(calls) % passes == 0
    per_pass = calls[: len(calls) // passes]
    assert len(per_pass) > len(plan.module.microbatches)  # some microbatch ran in several parts
    assert sorted(i for part in per_pass for i in part) == members  # every member once per pass
    assert calls == per_pass * passes
    for a, b in zip(results["harts"].metrics, results["baseline"].metrics):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9, abs=1e-12)
    assert results["harts"].old_log_probs.keys() == results["baseline"].old_log_probs.keys()
    for index, old in results["harts"].old_log_probs.items():
        torch.testing.assert_close(results["baseline"].old_log_probs[index], old, rtol=0, atol=1e-12)
    assert max_relative_difference(state(harts_model), state(baseline_model)) <= 1e-9


def test_first_epoch_ratios_are_exactly_one_and_reference_kl_starts_at_zero():
    batch = forked_batch()
    plan = harts.compile(batch, capacity=40, chunk_size=4)
    assert plan.stats["num_microbatches"] > 1
    model = copy.deepcopy(tiny_model())
    records = train(model, batch, plan, "harts", steps=2, reference=copy.deepcopy(model), epochs=2, kl_coef=0.05, recompute=True)
    for record in records:
        if record["epoch"] == 1:
            assert record["ratio_min"] == 1.0 and record["ratio_max"] == 1.0
            assert record["clip_fraction"] == 0.0 and record["approx_kl_old"] == 0.0
        else:
            assert record["ratio_max"] > 1.0 or record["ratio_min"] < 1.0
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0
    assert records[0]["compression"] == pytest.approx(plan.stats["compression"])


def test_expert_biases_move_by_the_whole_batchs_q_weighted_loads():
    batch = forked_batch()
    model = copy.deepcopy(tiny_model())
    before = [m.e_score_correction_bias.clone() for m in model.modules() if isinstance(m, TopKRouter)]
    plan = harts.compile(batch, capacity=40, chunk_size=4)
    out = log_probs(model, plan, batch)  # the loads of the one optimizer step below (same weights)
    rate = 1e-2
    train(model, batch, plan, "harts", steps=1, epochs=1, expert_bias_rate=rate)
    after = [m.e_score_correction_bias for m in model.modules() if isinstance(m, TopKRouter)]
    load = out.moe.assign_count
    assert float(load.sum(1).max()) == float(load.sum(1).min()) == 2 * batch.semantic_tokens  # q-weighted, top-2
    for layer, (a, b) in enumerate(zip(before, after)):
        torch.testing.assert_close(b - a, rate * torch.sign(load[layer].mean() - load[layer]), rtol=0, atol=1e-15)


def test_old_log_probs_from_the_batch_instead_of_recomputed():
    batch = forked_batch()
    plan = harts.compile(batch, capacity=40, chunk_size=4)
    model = copy.deepcopy(tiny_model())
    old = [np.concatenate([[0.0], lp.detach().numpy()]) for lp in log_probs(model, plan, batch).log_probs]
    fields = {name: values for name, values in batch.trajectory_fields.items()}
    with_old = harts.RolloutBatch.from_trajectories(
        [t.tolist() for t in batch.tokens], loss_mask=batch.loss_mask, old_log_probs=old, **fields
    )
    supplied = copy.deepcopy(model)
    want = train(model, batch, plan, "harts", steps=1, epochs=2)
    trainer = Trainer(supplied, torch.optim.AdamW(supplied.parameters(), lr=3e-3), TrainConfig(epochs=2, recompute_old_log_probs=False))
    got = trainer.step(with_old, harts.compile(with_old, capacity=40, chunk_size=4)).metrics
    assert got[0]["ratio_min"] == got[0]["ratio_max"] == 1.0
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)


def test_plan_and_process_group_mismatches_are_reported():
    batch = forked_batch()
    model = copy.deepcopy(tiny_model())
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    plan = harts.compile(batch, capacity=40, chunk_size=4, dp_size=2)
    assert len(replica_microbatches(plan.module, 0, 2)) == plan.stats["num_microbatches"] // 2
    with pytest.raises(TrainingError, match=r"compiled for 2 data-parallel replica\(s\).*process group has 1 rank"):
        trainer.step(batch, plan)
    other = rl_batch([t.tolist() + [1] for t in batch.tokens], seed=5)
    with pytest.raises(harts.PlanBatchMismatchError, match="not for this batch"):
        trainer.step(other, harts.compile(batch, capacity=40, chunk_size=4))
    with pytest.raises(TrainingError, match="kl_coef"):
        TrainConfig(algorithm="ppo", kl_coef=0.1)
    with pytest.raises(harts.RolloutInputError, match="ref_log_probs"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainConfig(kl_coef=0.1)).step(
            batch, harts.compile(batch, capacity=40, chunk_size=4))


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo process group of one rank, so that DDP and FSDP2 can wrap a model in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_and_fsdp2_wrapped_models_are_accepted(one_process_group):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    batch = forked_batch()
    plan = harts.compile(batch, capacity=40, chunk_size=4)
    start = copy.deepcopy(tiny_model())
    out = log_probs(DistributedDataParallel(copy.deepcopy(start)), plan, batch)  # no 'forward_hidden' needed on the wrapper
    torch.testing.assert_close(out.packed, log_probs(start, plan, batch).packed, rtol=0, atol=0)

    plain = copy.deepcopy(start)
    want = train(plain, batch, plan, "harts", epochs=2, aux_loss_coef=1e-2, expert_bias_rate=1e-3)
    ddp = DistributedDataParallel(copy.deepcopy(start), find_unused_parameters=True)
    got = train(ddp, batch, plan, "harts", epochs=2, aux_loss_coef=1e-2, expert_bias_rate=1e-3)
    sharded = copy.deepcopy(start)
    for layer in sharded.layers:
        fully_shard(layer)
    fully_shard(sharded)
    got_fsdp = train(sharded, batch, plan, "harts", epochs=2, aux_loss_coef=1e-2, expert_bias_rate=1e-3)
    for a, b, c in zip(got, got_fsdp, want):
        assert a["loss"] == pytest.approx(c["loss"], rel=1e-12) and b["loss"] == pytest.approx(c["loss"], rel=1e-12)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
    assert max_relative_difference(state(ddp.module), state(plain)) <= 1e-12
    assert max_relative_difference(full, state(plain)) <= 1e-12


# ----------------------------------------------------------------------------- harts train


def write_run_config(tmp_path, **extra):
    document = dict(steps=3, epochs=2, dtype="float64", chunk_size=4, capacity=40, lr=3e-3, aux_loss_coef=1e-2,
                    z_loss_coef=1e-3, seed=3, model=SMALL_MODEL, **extra)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_cli_train_harts_and_baseline_give_the_same_losses_and_weights(tmp_path):
    table = tmp_path / "rollouts.jsonl"
    forked_batch().write(table)
    config = write_run_config(tmp_path)
    records, weights = {}, {}
    for mode in ("harts", "baseline"):
        metrics, saved = tmp_path / f"{mode}.jsonl", tmp_path / f"{mode}.safetensors"
        arguments = ["train", str(table), "--config", str(config), "--mode", mode, "--metrics", str(metrics), "--save", str(saved)]
        if mode == "harts":
            arguments += ["--plot", str(tmp_path / "curves.png")]
        result = runner.invoke(app, arguments)
        assert result.exit_code == 0, result.output
        records[mode] = [json.loads(line) for line in metrics.read_text().splitlines()]
        weights[mode] = load_file(saved)
    assert [(r["step"], r["epoch"]) for r in records["harts"]] == [(s, e) for s in (1, 2, 3) for e in (1, 2)]
    required = {"step", "loss", "kl", "clip_fraction", "tokens", "compression", "fbgrad_seconds", "plan_seconds",
                "optimizer_seconds", "rows_per_second"}
    assert required <= records["harts"][0].keys()
    for record in records["harts"] + records["baseline"]:
        assert record["rows_per_second"] == pytest.approx(record["rows"] / record["fbgrad_seconds"], rel=1e-12)
    for a, b in zip(records["harts"], records["baseline"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9)
        if a["epoch"] == 1:
            assert a["ratio_min"] == a["ratio_max"] == 1.0
    assert records["harts"][0]["compression"] > 1.0 and records["baseline"][0]["compression"] == 1.0
    assert max_relative_difference(weights["harts"], weights["baseline"]) <= 1e-9
    biases = [v for k, v in weights["harts"].items() if k.endswith("e_score_correction_bias")]
    assert biases and all(float(b.abs().max()) > 0 for b in biases)  # the CLI's expert-bias updates ran
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # appending: a second run adds its lines after the first run's
    result = runner.invoke(app, ["train", str(table), "--config", str(config), "--steps", "1", "--metrics", str(tmp_path / "harts.jsonl")])
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "harts.jsonl").read_text().splitlines()) == 8


def test_cli_options_from_yaml_are_overridden_by_flags_and_checked(tmp_path):
    config = write_run_config(tmp_path, kl_coef=0.0, temperature=0.9)
    options = load_options({"steps": 5, "epochs": None}, config)
    assert options.steps == 5 and options.train.epochs == 2 and options.train.temperature == 0.9 and options.lr == 3e-3
    (tmp_path / "bad.yaml").write_text("steps: 2\nlearning_rate: 1e-3\n")
    result = runner.invoke(app, ["train", "demo", "--config", str(tmp_path / "bad.yaml")])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and f"config {tmp_path / 'bad.yaml'}: option 'learning_rate' is unknown" in output
    result = runner.invoke(app, ["train", "demo", "--mode", "fast"])
    assert result.exit_code == 2 and "mode must be one of" in " ".join(result.output.split())


def test_the_run_sets_the_matmul_precision_it_is_given_and_restores_the_callers(tmp_path, monkeypatch):
    from harts.train import loop

    seen = []
    step = loop.Trainer.step

    def recording_step(self, *args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(loop.Trainer, "step", recording_step)
    table = tmp_path / "rollouts.jsonl"
    forked_batch().write(table)
    before = torch.get_float32_matmul_precision()
    for precision, expected in (("medium", "medium"), (None, "highest")):  # None on CPU: exact fp32
        flags = {"input": str(table), "steps": 1, "epochs": 1, "matmul_precision": precision}
        loop.run_training(load_options(flags, write_run_config(tmp_path)), progress=False)
        assert seen[-1] == expected and torch.get_float32_matmul_precision() == before
    result = runner.invoke(app, ["train", str(table), "--config", str(write_run_config(tmp_path)), "--matmul-precision", "fast"])
    assert result.exit_code == 2 and "--matmul-precision must be one of" in " ".join(result.output.split())


def test_cli_run_trains_both_modes_and_compares(tmp_path):
    table = tmp_path / "rollouts.jsonl"
    forked_batch().write(table)
    result = runner.invoke(app, ["run", str(table), "--chunk-size", "4", "--capacity", "40", "--steps", "1", "--epochs", "2", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert [(row["step"], row["epoch"]) for row in figures["per_step"]] == [(1, 1), (1, 2)]
    assert figures["max_loss_rel_diff"] < 1e-4 and figures["fbgrad_speedup"] > 0  # float32
    assert figures["compression"] > 1.0
