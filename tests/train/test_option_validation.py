"""Every numeric, boolean and text option of ``harts train`` is checked where it is read (flags, YAML, the API),
and a step whose loss or gradient is not finite stops the run before any weight moves (issue 24)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

import harts
from harts.cli import USER_ERROR_EXIT, app
from harts.runtime import HybridConfig
from harts.runtime.config import HybridConfigError
from harts.train import NonFiniteStepError, TrainConfig, Trainer, TrainingError
from harts.train.loop import RunOptions, load_options
from tests.helpers import SMALL_MODEL, forked_batch, tiny_model

runner = CliRunner()


def one_line(text: str) -> str:
    return " ".join(text.split())


def config_file(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        ({"lr": math.inf}, ("option --lr", "must be a finite number", "inf")),
        ({"lr": math.nan}, ("option --lr", "finite")),
        ({"lr": 0.0}, ("option --lr", "must be > 0")),
        ({"seed": 10**23}, ("option --seed", "must be <=")),
        ({"seed": -1}, ("option --seed", "must be >= 0")),
        ({"temperature": 1e-45}, ("option --temperature", "must be >= 0.001", "one-hot")),
        ({"temperature": math.inf}, ("option --temperature", "finite")),
        ({"kl_coef": -1.0}, ("option --kl-coef", "must be >= 0")),
        ({"steps": 0}, ("option --steps", "must be >= 1")),
        ({"capacity": 2**40}, ("option --capacity", "must be <=")),
        ({"chunk_size": 10**6}, ("option --chunk-size", "must be <=")),
        ({"parallel": "zero"}, ("option --parallel", "must be one of ddp, fsdp")),
        ({"preset": "tiny", "hf": "/nowhere"}, ("option --hf and option --preset do not go together",)),
        ({"task": "count", "dp": 2}, ("option --task and option --dp do not go together",)),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(flags, fragments):
    with pytest.raises(TrainingError) as caught:
        load_options(flags)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("entropy_coef: .nan\n", ("option 'entropy_coef'", "finite", "nan")),
        ("entropy_coef: -.inf\n", ("option 'entropy_coef'", "finite")),
        ("weight_decay: -1\n", ("option 'weight_decay'", "must be >= 0")),
        ("weight_decay: .nan\n", ("option 'weight_decay'", "finite")),
        ("max_grad_norm: 0\n", ("option 'max_grad_norm'", "must be > 0", "zero every update")),
        ("seed: 1e23\n", ("option 'seed'", "must be an int", "1e23")),
        ("seed: 1.0e+23\n", ("option 'seed'", "must be <=")),
        ("seed: .inf\n", ("option 'seed'", "must be an int")),
        ("with_entropy: 'false'\n", ("option 'with_entropy'", "must be true or false", "quoted")),
        ("recompute: 'no'\n", ("option 'recompute'", "must be true or false")),
        ("recompute: 1\n", ("option 'recompute'", "must be true or false")),
        ("metrics: 5\n", ("option 'metrics'", "must be a string", "5")),
        ("model: 5\n", ("option 'model'", "mapping")),
        ("steps: 2\nsteps: 3\n", ("not valid YAML", "'steps' is given twice")),
        ("model:\n  num_layers: 2\n  num_layers: 3\n", ("'num_layers' is given twice",)),
        ("lerning_rate: 1\n", ("option 'lerning_rate' is unknown",)),
        ("entropy_coeff: 0.1\n", ("did you mean 'entropy_coef'?",)),
    ],
)
def test_bad_yaml_values_are_refused_naming_the_file_and_key(tmp_path, text, fragments):
    path = config_file(tmp_path, text)
    with pytest.raises(TrainingError) as caught:
        load_options({}, path)
    message = str(caught.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_unquoted_yaml_booleans_and_numbers_still_read(tmp_path):
    path = config_file(tmp_path, "with_entropy: false\nrecompute: true\nlr: 1e-3\nseed: 7\nmax_grad_norm: null\n")
    options = load_options({}, path)
    assert options.train.with_entropy is False and options.train.recompute is True
    assert options.lr == 1e-3 and options.seed == 7 and options.train.max_grad_norm is None


@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not math.isfinite(v)),
                       st.text(max_size=5), st.booleans()))
def test_the_api_refuses_non_finite_or_mistyped_numbers(value):
    for build in (lambda: TrainConfig(entropy_coef=value), lambda: TrainConfig(clip_eps=value),
                  lambda: RunOptions(lr=value), lambda: RunOptions(weight_decay=value)):
        with pytest.raises(TrainingError):
            build()


@given(value=st.sampled_from(["false", "no", "0", 0, 1, None]))
def test_the_api_refuses_non_boolean_flags(value):
    with pytest.raises(TrainingError, match="must be true or false"):
        TrainConfig(with_entropy=value)


@pytest.mark.parametrize(("override", "field"), [({"num_layers": "four"}, "num_layers"),
                                                  ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
                                                  ({"qk_norm": "no"}, "qk_norm"),
                                                  ({"hidden_size": 2.5}, "hidden_size")])
def test_model_overrides_of_the_wrong_type_name_the_field(override, field):
    with pytest.raises(HybridConfigError, match=field):
        HybridConfig.preset("tiny", **override)


def test_model_overrides_of_the_wrong_type_exit_2_from_the_cli(tmp_path):
    path = config_file(tmp_path, "model:\n  num_layers: four\n")
    result = runner.invoke(app, ["train", "demo", "--config", str(path), "--steps", "1"])
    assert result.exit_code == USER_ERROR_EXIT, result.output
    assert "num_layers must be an integer, got 'four'" in one_line(result.output)


def test_lr_inf_exits_2_before_training_and_writes_nothing(tmp_path):
    saved = tmp_path / "weights.safetensors"
    result = runner.invoke(app, ["train", "demo", "--lr", "inf", "--save", str(saved)])
    assert result.exit_code == USER_ERROR_EXIT, result.output
    assert "option --lr must be a finite number, got inf" in one_line(result.output)
    assert not saved.exists()


def test_a_diverging_run_stops_with_a_clear_error_and_saves_no_weights(tmp_path):
    """A learning rate large enough to blow the weights up in one step: the next step's loss is not finite,
    the run stops there (exit 2) and the weights are never written."""
    table, saved = tmp_path / "rollouts.jsonl", tmp_path / "weights.safetensors"
    forked_batch().write(table)
    config = config_file(tmp_path, yaml.safe_dump(dict(model=SMALL_MODEL, chunk_size=4, capacity=40, dtype="float32")))
    result = runner.invoke(app, ["train", str(table), "--config", str(config), "--lr", "1e30", "--steps", "2",
                                 "--epochs", "1", "--save", str(saved)])
    assert result.exit_code == USER_ERROR_EXIT, result.output
    output = one_line(result.output)
    assert "the optimizer step was not taken" in output and "nan" in output.lower()
    assert not saved.exists()


def non_finite_model(batch, plan):
    """A model whose LM head holds an inf: every log-prob, hence the loss, is NaN."""
    model = copy.deepcopy(tiny_model())
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.inf
    return model


def test_a_non_finite_step_moves_no_weight():
    batch = forked_batch()
    plan = harts.compile(batch, capacity=40, chunk_size=4)
    model = non_finite_model(batch, plan)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), TrainConfig())
    with pytest.raises(NonFiniteStepError, match="step 1, epoch 1: the loss is nan"):
        trainer.step(batch, plan)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_huge_advantages_that_overflow_the_loss_are_refused():
    """Advantages of 1e38 are finite, but the float32 loss they weigh overflows: refused, weights untouched."""
    batch = forked_batch()
    big = harts.RolloutBatch.from_trajectories([t.tolist() for t in batch.tokens], loss_mask=batch.loss_mask,
                                               advantages=np.full(len(batch), 1e38))
    plan = harts.compile(big, capacity=40, chunk_size=4)
    model = copy.deepcopy(tiny_model(dtype="float32"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), TrainConfig(max_grad_norm=None))
    with pytest.raises(NonFiniteStepError):
        trainer.step(big, plan)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
