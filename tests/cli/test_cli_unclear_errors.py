"""Inputs that used to end in "internal error" (exit 3) or a raw exception now give one clear line, exit 2,
naming the file, option or key (issue 24, "Unclear errors")."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import harts
from harts.cli import USER_ERROR_EXIT, _one_line, app
from harts.errors import HartsError, PipelineError
from harts.models import HFModelError, from_hf, save_pretrained

runner = CliRunner()


def assert_user_error(arguments, *fragments):
    result = runner.invoke(app, [str(a) for a in arguments])
    output = " ".join(result.output.split())
    assert result.exit_code == USER_ERROR_EXIT, result.output
    assert output.startswith("error: ") and "internal error" not in output, output
    for fragment in fragments:
        assert fragment in output, output


def verl_file(tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
                "responses": torch.tensor([[3]]), "response_mask": torch.ones(1, 1, dtype=torch.long)}, path)
    return path


def test_convert_an_empty_pt_file(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    assert_user_error(["convert", tmp_path / "empty.pt", "--from", "verl", "-o", tmp_path / "o.jsonl"], "empty.pt: the file is empty")


def test_convert_a_truncated_pt_file(tmp_path):
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(verl_file(tmp_path).read_bytes()[:100])
    assert_user_error(["convert", truncated, "--from", "verl", "-o", tmp_path / "o.jsonl"], "cut.pt: not a torch file")


def test_convert_latin1_jsonl(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"input_ids": [1, 2], "note": "caf\xe9"}\n'.encode("latin-1"))
    assert_user_error(["convert", path, "--from", "areal", "--not-rolled", "-o", tmp_path / "o.jsonl"], "latin.jsonl, line 1: not UTF-8 text")


def test_convert_deeply_nested_jsonl(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert_user_error(["convert", path, "--from", "areal", "--not-rolled", "-o", tmp_path / "o.jsonl"], "deep.jsonl, line 1: nested too deeply")


def test_convert_a_ragged_column(tmp_path):
    path = tmp_path / "ragged.jsonl"
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "x": [1, 2, 3]}, {"input_ids": [1, 2], "loss_mask": [0, 1], "x": [[1], [2]]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert_user_error(["convert", path, "--from", "areal", "--not-rolled", "-o", tmp_path / "o.jsonl"], "key 'x': its rows are ragged")


def test_convert_an_ignore_typo(tmp_path):
    assert_user_error(["convert", verl_file(tmp_path), "--from", "verl", "-o", tmp_path / "o.jsonl", "--ignore", "respnses"],
                      "--ignore 'respnses' names no key of the batch; did you mean 'responses'?")
    assert not (tmp_path / "o.jsonl").exists()


def test_a_pipeline_that_lays_out_twice():
    pipeline = ",".join(harts.DEFAULT_PIPELINE) + ",lay-out"
    with pytest.raises(PipelineError, match="'lay-out' is the last pass of a pipeline"):
        harts.compile(harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4]]), capacity=40, chunk_size=4, pipeline=pipeline)


@pytest.mark.parametrize(("spec", "fragment"), [("count:modulus=2e9", "option 'modulus' must be int"),
                                                ("count:modulus=2000000000", "modulus must be an int in [2, 1024]"),
                                                ("count:turn_length=100000", "turn_length must be an int in [1, 64]"),
                                                ("count:prompts=1000000", "prompts must be an int in [1, 1024]")])
def test_task_options_are_bounded(spec, fragment):
    assert_user_error(["train", "--task", spec, "--steps", "1"], fragment)


def test_hf_on_an_empty_directory(tmp_path):
    with pytest.raises(HFModelError, match="holds no config.json"):
        from_hf(tmp_path)
    assert_user_error(["train", "demo", "--hf", tmp_path, "--steps", "1"], "holds no config.json")


def test_hf_with_a_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(HFModelError, match="cannot read its config.json"):
        from_hf(tmp_path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.helpers.hf import qwen3_next_config

    hf_config = qwen3_next_config()
    hf_config.dtype = torch.float32
    return save_pretrained(from_hf(hf_config), tmp_path_factory.mktemp("hf") / "checkpoint")


def copy_checkpoint(source, target):
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def test_hf_with_truncated_weights(checkpoint, tmp_path):
    broken = copy_checkpoint(checkpoint, tmp_path / "cut")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(HFModelError, match="cannot load the weights"):
        from_hf(broken)


def test_hf_with_a_config_inconsistent_with_the_weights(checkpoint, tmp_path):
    broken = copy_checkpoint(checkpoint, tmp_path / "odd")
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] = config["hidden_size"] * 2
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(HartsError, match="cannot load the weights|hidden_size|shape"):
        from_hf(broken)


class PicklablePayload:
    """An object torch.save pickles and torch.load(weights_only=True) refuses."""


def test_hf_with_a_bin_checkpoint_the_safe_loader_refuses(checkpoint, tmp_path):
    """A .bin checkpoint whose pickle holds an object: torch.load(weights_only=True) refuses it."""
    broken = copy_checkpoint(checkpoint, tmp_path / "bin")
    (broken / "model.safetensors").unlink()

    torch.save({"model.embed_tokens.weight": PicklablePayload()}, broken / "pytorch_model.bin")
    with pytest.raises(HFModelError, match="cannot load the weights"):
        from_hf(broken)


def test_ansi_escapes_are_stripped_from_error_text():
    assert _one_line("\x1b[1;31mRuntimeError\x1b[0m: bad\n  thing") == "RuntimeError: bad thing"


def test_kernel_bench_without_fla_is_a_clear_error(tmp_path):
    from harts.kernels.linear_attention.chunk import fla_available
    from harts_bench.runtime import main

    if fla_available():
        pytest.skip("flash-linear-attention is installed: the kernel bench runs")
    with pytest.raises(HartsError, match="--kernel-bench times flash-linear-attention's kernels"):
        main(["--device", "cpu", "--kernel-bench", "--out", str(tmp_path / "bench.json")])
    assert not (tmp_path / "bench.json").exists()
