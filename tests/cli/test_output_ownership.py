"""Issue 24, item 1: every output of the CLI and the library follows one ownership rule (harts.fsio.check_outputs).

An output is written only when nothing is there yet or when what is there is HARTS's own artifact of the same
kind; an input of the same run, a path two outputs share, a directory named for a file and any other file are
refused with one line naming the option and the path, before any work starts, and left byte for byte as they were.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors import safe_open
from safetensors.numpy import save_file
from typer.testing import CliRunner

import harts
from harts.cli import USER_ERROR_EXIT, app
from harts.errors import OutputError
from harts.fsio import ARTIFACT_KEY, METRICS_MARKER
from tests.helpers import SMALL_MODEL, forked_batch, small_batch

pytestmark = pytest.mark.usefixtures("single_thread")

runner = CliRunner()


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (directories as None, symlinks as their target) with its bytes."""
    return {str(p.relative_to(root)): (f"-> {os.readlink(p)}".encode() if p.is_symlink() else None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


def one_line(result) -> str:
    return " ".join(result.output.split())


@pytest.fixture
def run_files(tmp_path):
    """A node table and a run config small enough to train in a second (float64, one step of one epoch)."""
    table = tmp_path / "in.jsonl"
    forked_batch().write(table)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(dict(steps=1, epochs=1, dtype="float64", chunk_size=4, capacity=40, lr=3e-3, seed=3,
                                          model=SMALL_MODEL)))
    return table, config


@pytest.fixture
def no_training(monkeypatch):
    """Any work the CLI starts fails the test: the ownership checks must come first."""
    def started(*_args, **_kwargs):
        raise AssertionError("work started before the outputs were checked")

    for target in ("harts.train.loop.run_training", "harts.train.online.run_online", "harts.train.demo.run_demo",
                   "harts.load_plan", "harts.compile"):
        monkeypatch.setattr(target, started)


def user_files(tmp_path: Path) -> None:
    """What a user keeps beside a run: text, a CSV, another program's safetensors and JSONL, links."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "keep.txt").write_text("a user's results")
    (tmp_path / "thesis.txt").write_text("chapter 1\n")
    (tmp_path / "results.csv").write_text("step,loss\n1,0.5\n")
    save_file({"w": np.zeros(3, dtype=np.float32)}, str(tmp_path / "weights.safetensors"), metadata={"format": "np"})
    (tmp_path / "notes.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    os.link(tmp_path / "in.jsonl", tmp_path / "in-hardlink.jsonl")
    os.symlink("thesis.txt", tmp_path / "curves.png")


# option flags -> the fragment the one-line error must hold ({tmp} is the run's directory)
FOREIGN_TRAIN_OUTPUTS = {
    "--save onto a text file": (["--save", "thesis.txt"], "--save thesis.txt: it exists and is not a weights file HARTS wrote (it is not a safetensors file)"),
    "--plot onto a CSV": (["--plot", "results.csv"], "--plot results.csv: it exists and is not a figure HARTS drew (it is not a PNG image)"),
    "--metrics onto a safetensors file": (["--metrics", "weights.safetensors"], "--metrics weights.safetensors: it exists and is not a HARTS metrics file (line 1 is not"),
    "--metrics onto another program's JSONL": (["--metrics", "notes.jsonl"], "--metrics notes.jsonl: it exists and is not a HARTS metrics file"),
    "--metrics onto the input table": (["--metrics", "in.jsonl"], "--metrics in.jsonl: that is in.jsonl, an input of this run"),
    "--save onto the input table": (["--save", "in.jsonl"], "--save in.jsonl: that is in.jsonl, an input of this run"),
    "--metrics onto a hard link of the input": (["--metrics", "in-hardlink.jsonl"], "--metrics in-hardlink.jsonl: that is in.jsonl, an input of this run"),
    "--save onto the config": (["--save", "run.yaml"], "--save run.yaml: that is run.yaml, an input of this run"),
    "--save onto a directory": (["--save", "results"], "--save results: it is a directory; name a file"),
    "--plot onto a directory": (["--plot", "results"], "--plot results: it is a directory; name a file"),
    "--plot onto a symlink": (["--plot", "curves.png"], "--plot curves.png: it is a symbolic link"),
    "--save and --metrics on one path": (["--save", "out.bin", "--metrics", "out.bin"], "--metrics out.bin and --save out.bin would write over each other"),
    "--save below a file": (["--save", "thesis.txt/w.safetensors"], "--save thesis.txt/w.safetensors: thesis.txt is not a directory"),
}


@pytest.mark.parametrize("case", sorted(FOREIGN_TRAIN_OUTPUTS))
def test_train_refuses_outputs_it_does_not_own_before_any_work(tmp_path, run_files, no_training, monkeypatch, case):
    flags, message = FOREIGN_TRAIN_OUTPUTS[case]
    user_files(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", "in.jsonl", "--config", "run.yaml", *flags])
    assert result.exit_code == USER_ERROR_EXIT, result.output
    assert message in one_line(result)
    assert "Traceback" not in result.output
    assert snapshot(tmp_path) == before


def test_the_library_checks_a_runs_outputs_before_building_anything(tmp_path, run_files, monkeypatch):
    from harts.train.loop import load_options, run_training

    table, config = run_files
    (tmp_path / "thesis.txt").write_text("chapter 1\n")
    monkeypatch.setattr("harts.train.loop.build_model", lambda *a, **k: pytest.fail("the model was built"))
    options = load_options({"input": str(table), "save": str(tmp_path / "thesis.txt")}, config)
    with pytest.raises(OutputError, match="--save .*thesis.txt: it exists and is not a weights file HARTS wrote"):
        run_training(options, progress=False)
    assert (tmp_path / "thesis.txt").read_text() == "chapter 1\n"


def test_online_training_refuses_foreign_outputs_before_sampling(tmp_path, monkeypatch):
    (tmp_path / "thesis.txt").write_text("chapter 1\n")
    monkeypatch.setattr("harts.train.online.build_task_model", lambda *a, **k: pytest.fail("the policy was built"))
    result = runner.invoke(app, ["train", "--task", "count", "--steps", "1", "--save", str(tmp_path / "thesis.txt")])
    assert result.exit_code == USER_ERROR_EXIT and "is not a weights file HARTS wrote" in one_line(result)
    assert (tmp_path / "thesis.txt").read_text() == "chapter 1\n"


def test_train_replaces_its_own_outputs_and_appends_to_its_own_metrics(tmp_path, run_files):
    table, config = run_files
    outputs = ["--metrics", str(tmp_path / "m.jsonl"), "--plot", str(tmp_path / "c.png"), "--save", str(tmp_path / "w.safetensors")]
    for run in range(2):
        result = runner.invoke(app, ["train", str(table), "--config", str(config), *outputs])
        assert result.exit_code == 0, result.output
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 2 and all(line.startswith(f'{{"{METRICS_MARKER}": ') for line in lines)
    assert [r["step"] for r in records] == [1, 1] and all(r[METRICS_MARKER] == harts.__version__ for r in records)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        assert handle.metadata()[ARTIFACT_KEY] == "weights"
    from PIL import Image

    with Image.open(tmp_path / "c.png") as image:
        assert "harts" in image.info[ARTIFACT_KEY]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png", "in.jsonl", "m.jsonl", "run.yaml", "w.safetensors"]


def test_harts_run_refuses_to_draw_over_a_text_file(tmp_path, no_training, monkeypatch):
    notes = tmp_path / "notes.txt"
    notes.write_text("meeting notes\n")
    result = runner.invoke(app, ["run", "--plot", str(notes), "--steps", "1"])
    assert result.exit_code == USER_ERROR_EXIT
    assert f"--plot {notes}: it exists and is not a figure HARTS drew" in one_line(result)
    assert notes.read_text() == "meeting notes\n"


def test_run_demo_checks_its_plot_before_reading_the_batch(tmp_path, monkeypatch):
    from harts.train.demo import run_demo

    notes = tmp_path / "notes.txt"
    notes.write_text("meeting notes\n")
    monkeypatch.setattr("harts.train.demo.resolve_input", lambda *a, **k: pytest.fail("the batch was read"))
    with pytest.raises(OutputError, match="is not a figure HARTS drew"):
        run_demo("demo", plot=notes)
    assert notes.read_text() == "meeting notes\n"


# ----------------------------------------------------------------------------- inspect --plot


@pytest.fixture
def plan_dir(tmp_path):
    batch = harts.RolloutBatch.from_trajectories([list(range(1, 20)) + [30, 31], list(range(1, 20)) + [40], [60, 61, 62]])
    return harts.compile(batch, capacity=40, chunk_size=8).save(tmp_path / "plan")


def test_inspect_plot_leaves_a_users_histograms_png_and_draws_nothing(tmp_path, plan_dir):
    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "histograms.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's figure")
    before = snapshot(tmp_path)
    result = runner.invoke(app, ["inspect", str(plan_dir), "--plot", str(figures)])
    assert result.exit_code == USER_ERROR_EXIT
    assert f"--plot {figures / 'histograms.png'}: it exists and is not a figure HARTS drew" in one_line(result)
    assert snapshot(tmp_path) == before  # not even the first figure was drawn


def test_inspect_plot_replaces_its_own_figures_and_keeps_the_users_files_beside_them(tmp_path, plan_dir):
    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "README").write_text("figures for the paper")
    for _ in range(2):
        result = runner.invoke(app, ["inspect", str(plan_dir), "--plot", str(figures)])
        assert result.exit_code == 0, result.output
    names = sorted(p.name for p in figures.iterdir())
    assert names[:1] == ["README"] and {"slot_work.png", "histograms.png"} <= set(names) and len(names) == 4
    assert (figures / "README").read_text() == "figures for the paper"


@pytest.mark.parametrize("case", ["the plan itself", "a file", "microbatch without plot"])
def test_inspect_refuses_bad_plot_targets_in_one_line(tmp_path, plan_dir, no_training, case):
    (tmp_path / "notes.txt").write_text("mine")
    arguments, message = {
        "the plan itself": (["--plot", str(plan_dir)], f"--plot {plan_dir}: that is {plan_dir}, an input of this run"),
        "a file": (["--plot", str(tmp_path / "notes.txt")], f"--plot {tmp_path / 'notes.txt'}: it exists and is not a directory"),
        "microbatch without plot": (["--microbatch", "0"], "--microbatch 0 picks the segment tree that --plot draws; give --plot DIR too"),
    }[case]
    before = snapshot(tmp_path)
    result = runner.invoke(app, ["inspect", str(plan_dir), *arguments])
    assert result.exit_code == USER_ERROR_EXIT and message in one_line(result), result.output
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- compile --dump-ir and -o


def compile_arguments(output: Path, *extra: str) -> list[str]:
    return ["compile", "demo", "-o", str(output), "--chunk-size", "16", "--capacity", "4096", *extra]


def test_dump_ir_refuses_a_directory_holding_a_users_file_even_one_named_like_a_stage(tmp_path, no_training):
    dump = tmp_path / "ir"
    dump.mkdir()
    (dump / "003_schedule-slots.txt").write_text("my notes on scheduling")
    before = snapshot(tmp_path)
    result = runner.invoke(app, compile_arguments(tmp_path / "p", "--dump-ir", str(dump)))
    assert result.exit_code == USER_ERROR_EXIT
    assert f"--dump-ir {dump}: it exists and is not an IR dump HARTS wrote (it also holds 003_schedule-slots.txt)" in one_line(result)
    assert snapshot(tmp_path) == before


def test_a_new_dump_clears_the_stale_stages_of_an_earlier_one(tmp_path):
    from harts.ir.text import parse_ir

    dump = tmp_path / "ir"
    assert runner.invoke(app, compile_arguments(tmp_path / "p", "--dump-ir", str(dump))).exit_code == 0
    assert len(list(dump.iterdir())) == len(harts.DEFAULT_PIPELINE)
    result = runner.invoke(app, compile_arguments(tmp_path / "p", "--dump-ir", str(dump), "--pipeline", "prefix-compress"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dump.iterdir()) == ["000_lower.txt", "001_prefix-compress.txt"]
    assert parse_ir((dump / "001_prefix-compress.txt").read_text()).phase.name == "COMPRESSED"


def test_the_dump_directory_from_the_environment_follows_the_same_rule(tmp_path, monkeypatch):
    dump = tmp_path / "ir"
    dump.mkdir()
    (dump / "mine.txt").write_text("mine")
    monkeypatch.setenv("HARTS_DUMP_IR", str(dump))
    with pytest.raises(OutputError, match=r"cannot dump the IR to .*ir: it exists and is not an IR dump HARTS wrote \(it also holds mine.txt\)"):
        harts.compile(small_batch(), pipeline="prefix-compress")
    assert sorted(p.name for p in dump.iterdir()) == ["mine.txt"]


@pytest.mark.parametrize("case", ["dump into the plan", "plan onto the input", "plan inside the dump"])
def test_compile_outputs_may_not_overlap_each_other_or_the_input(tmp_path, no_training, case):
    table = tmp_path / "in.jsonl"
    small_batch().write(table)
    plan = tmp_path / "p"
    arguments, message = {
        "dump into the plan": (compile_arguments(plan, "--dump-ir", str(plan)), "would write over each other"),
        "plan onto the input": (["compile", str(table), "-o", str(table)], f"--output {table}: that is {table}, an input of this run"),
        "plan inside the dump": (compile_arguments(tmp_path / "ir" / "p", "--dump-ir", str(tmp_path / "ir")), "would write over each other"),
    }[case]
    before = snapshot(tmp_path)
    result = runner.invoke(app, arguments)
    assert result.exit_code == USER_ERROR_EXIT and message in one_line(result), result.output
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- node tables (convert -o, RolloutBatch.write)


def test_a_users_jsonl_that_starts_with_a_schema_like_line_is_not_overwritten(tmp_path):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"kind":"schema","version":1}\n{"my": "records"}\n')
    with pytest.raises(OutputError, match="mine.jsonl: it exists and is not a node table HARTS wrote"):
        small_batch().write(mine)
    assert mine.read_text() == '{"kind":"schema","version":1}\n{"my": "records"}\n'


def test_a_node_table_edited_after_harts_wrote_it_is_the_users(tmp_path):
    table = tmp_path / "t.jsonl"
    small_batch().write(table)
    small_batch().write(table)  # ours: replaced
    table.write_text(table.read_text().replace('"token_ids":[1', '"token_ids":[9', 1))
    before = table.read_bytes()
    with pytest.raises(OutputError, match="its rows and content hash disagree"):
        small_batch().write(table)
    assert table.read_bytes() == before


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_batch_write_refuses_foreign_files_and_replaces_its_own(tmp_path, suffix):
    target = tmp_path / f"t{suffix}"
    target.write_bytes(b"PAR1 not really" if suffix == ".parquet" else b"user data\n")
    before = target.read_bytes()
    with pytest.raises(OutputError, match=f"cannot write the node table to .*t{suffix}: it exists and is not a node table HARTS wrote"):
        small_batch().write(target)
    assert target.read_bytes() == before
    target.unlink()
    small_batch().write(target)
    harts.RolloutBatch.from_trajectories([[5, 6, 7]]).write(target)
    assert harts.RolloutBatch.read(target).tokens[0].tolist() == [5, 6, 7]


def test_convert_refuses_a_users_jsonl_whose_first_line_holds_kind_schema(tmp_path):
    import torch

    from tests.cli.test_interop_cli import episodes_and_values, verl_batch

    episodes, values = episodes_and_values()
    source = tmp_path / "batch.pt"
    torch.save({k: torch.as_tensor(v) for k, v in verl_batch(episodes, values).items() if k != "uid"}, source)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"kind":"schema","note":"my own format"}\n{"x": 1}\n')
    result = runner.invoke(app, ["convert", str(source), "--from", "verl", "-o", str(mine)])
    assert result.exit_code == USER_ERROR_EXIT and f"--output {mine}: it exists and is not a node table HARTS wrote" in one_line(result)
    assert mine.read_text() == '{"kind":"schema","note":"my own format"}\n{"x": 1}\n'


# ----------------------------------------------------------------------------- weights (the API)


def test_save_weights_refuses_foreign_files_and_replaces_its_own(tmp_path):
    from harts.train.loop import save_weights
    from tests.helpers import tiny_model

    model = tiny_model()
    thesis = tmp_path / "thesis.txt"
    thesis.write_text("chapter 1\n")
    with pytest.raises(OutputError, match="cannot write the weights to .*thesis.txt: it exists and is not a weights file HARTS wrote"):
        save_weights(model, thesis)
    assert thesis.read_text() == "chapter 1\n"
    plan_file = harts.compile(small_batch(), capacity=64, chunk_size=4).save(tmp_path / "plan.safetensors")
    before = plan_file.read_bytes()
    with pytest.raises(OutputError, match="no HARTS weights marker"):
        save_weights(model, plan_file)
    assert plan_file.read_bytes() == before
    target = tmp_path / "w.safetensors"
    save_weights(model, target)
    save_weights(model, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.safetensors", "thesis.txt", "w.safetensors"]


def test_save_pretrained_follows_the_same_rule(tmp_path):
    from harts.models import HFModelError, save_pretrained
    from tests.helpers import tiny_model

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(HFModelError, match="notes.txt is not a directory"):
        save_pretrained(tiny_model(), tmp_path / "notes.txt" / "checkpoint")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(HFModelError, match="it is a symbolic link"):
        save_pretrained(tiny_model(), tmp_path / "link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "notes.txt"]
