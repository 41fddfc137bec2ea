"""The real CLI (a subprocess) on bad input, bad options and unwritable outputs: one line on stderr naming the
file / tree / node / field or option, a non-zero exit, no traceback, and nothing written or deleted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import harts
from harts.cli import INTERNAL_ERROR_EXIT, USER_ERROR_EXIT, app
from tests.helpers import REPO

ROOT = REPO


def harts_cli(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "60"}  # narrow: a wrapped message would show
    return subprocess.run([sys.executable, "-m", "harts", *arguments], cwd=cwd, capture_output=True, text=True,
                          env=environment, timeout=600)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == USER_ERROR_EXIT, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def node_line(**fields) -> str:
    return json.dumps({"kind": "node", "tree_id": 0, "node_id": 0, "parent_id": None, "token_ids": [1, 2, 3], **fields})


BAD_INPUTS = {
    "not UTF-8": (b"\xff\xfe\x00garbage\n", "bad.jsonl: line 1 is not UTF-8 text"),
    "garbage": (b"this is not json at all\n", "bad.jsonl: line 1 is not valid JSON"),
    "huge id": ((node_line(node_id=10**30) + "\n").encode(), "bad.jsonl: record 0 (node): column 'node_id' is 1000000000000000000000000000000"),
    "ragged tokens": ((node_line(token_ids=[[1], [2, 3]]) + "\n").encode(), "bad.jsonl: tree 0, node 0: column 'token_ids' is ragged"),
    "nan mask": ((node_line(loss_mask=[1, float("nan"), 1]) + "\n").encode(), "tree 0, node 0: field 'loss_mask' entry 1 is nan"),
    "partial mask": ((node_line(loss_mask=[1, 1, 0]) + "\n" + json.dumps({"kind": "node", "tree_id": 0, "node_id": 1, "parent_id": 0,
                                                                         "token_ids": [4]}) + "\n").encode(),
                     "tree 0, node 1: missing field 'loss_mask' that other nodes have"),
    "empty": (b"", "bad.jsonl: node table: no node rows"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_node_tables_give_one_line_naming_the_file_and_the_culprit(tmp_path, case):
    content, message = BAD_INPUTS[case]
    (tmp_path / "bad.jsonl").write_bytes(content)
    result = harts_cli("compile", "bad.jsonl", "-o", "out.plan", cwd=tmp_path)
    assert_one_line_error(result, message)
    assert not (tmp_path / "out.plan").exists()


def test_a_damaged_parquet_file_and_a_damaged_plan_are_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + os.urandom(300))
    assert_one_line_error(harts_cli("compile", "bad.parquet", "-o", "out.plan", cwd=tmp_path), "bad.parquet: not a readable Parquet file")
    plan = harts.compile(harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4]]), capacity=16, chunk_size=2)
    plan.save(tmp_path / "p.plan")
    (tmp_path / "p.plan" / "manifest.json").write_bytes(b"\x00\xff corrupted")
    assert_one_line_error(harts_cli("inspect", "p.plan", "--json", cwd=tmp_path), "p.plan/manifest.json: truncated or not JSON")


DEGENERATE_OPTIONS = {
    "empty pipeline": (["--pipeline", ""], "the pipeline is empty"),
    "absurd chunk": (["--chunk-size", "1000000"], "option 'chunk_size' is 1,000,000, above 4,096"),
    "capacity beyond int32": (["--capacity", str(2**40)], "option 'capacity' is 1,099,511,627,776"),
    "zero dp": (["--dp", "0"], "option 'dp_size' must be a positive integer, got 0"),
}


@pytest.mark.parametrize("case", sorted(DEGENERATE_OPTIONS))
def test_degenerate_options_are_refused_and_nothing_is_written(tmp_path, case):
    options, message = DEGENERATE_OPTIONS[case]
    result = harts_cli("compile", "demo", "-o", "out.plan", *options, cwd=tmp_path)
    assert_one_line_error(result, message)
    assert list(tmp_path.iterdir()) == []


def test_dump_ir_onto_a_file_and_unwritable_outputs_are_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    result = harts_cli("compile", "demo", "-o", "out.plan", "--chunk-size", "16", "--capacity", "4096", "--dump-ir", "notes.txt", cwd=tmp_path)
    assert_one_line_error(result, "--dump-ir notes.txt: it exists and is not a directory")
    result = harts_cli("compile", "demo", "-o", "notes.txt/out.plan", "--chunk-size", "16", "--capacity", "4096", cwd=tmp_path)
    assert_one_line_error(result, "--output notes.txt/out.plan: notes.txt is not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "keep me"


def read_only_target(tmp_path: Path) -> Path:
    """A path whose directory refuses writes: a mode-555 directory, or (root ignores modes) sysfs."""
    if os.geteuid() != 0:
        directory = tmp_path / "read-only"
        directory.mkdir()
        directory.chmod(0o555)
        return directory / "out.plan"
    probe = Path("/sys/harts-write-probe")
    try:
        probe.mkdir()
    except OSError:
        return Path("/sys/harts-test.plan")
    probe.rmdir()
    pytest.skip("no read-only directory available to root here")


def test_a_read_only_output_is_reported_in_one_line(tmp_path):
    target = read_only_target(tmp_path)
    result = harts_cli("compile", "demo", "-o", str(target), "--chunk-size", "16", "--capacity", "4096", cwd=tmp_path)
    assert_one_line_error(result, f"cannot save the plan to {target}")
    assert not target.exists()


def test_run_on_degenerate_batches_fails_cleanly(tmp_path):
    (tmp_path / "single.jsonl").write_text(json.dumps({"kind": "node", "tree_id": 0, "node_id": 0, "parent_id": None, "token_ids": [5]}) + "\n")
    assert_one_line_error(harts_cli("run", "single.jsonl", "--steps", "1", "--epochs", "1", cwd=tmp_path),
                          "every trajectory has a single token, so no token has a log-prob to train on")
    (tmp_path / "nan.jsonl").write_text(node_line(loss_mask=[1.0, float("nan"), 0.0]) + "\n")
    assert_one_line_error(harts_cli("run", "nan.jsonl", "--steps", "1", "--epochs", "1", "--json", cwd=tmp_path), "field 'loss_mask' entry 1 is nan")


def test_run_json_is_valid_json_with_finite_figures(tmp_path):
    trajectory = {"kind": "trajectory", "tree_id": 0, "leaf": 0, "trajectory_id": 0, "advantage": 1.0}
    (tmp_path / "two.jsonl").write_text(node_line(loss_mask=[0, 1, 1]) + "\n" + json.dumps(trajectory) + "\n")
    result = harts_cli("run", "two.jsonl", "--steps", "1", "--epochs", "1", "--json", "--chunk-size", "2", "--capacity", "16", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert all(math.isfinite(v) for v in figures.values() if isinstance(v, float))


def test_run_refuses_non_finite_figures_instead_of_printing_nan(monkeypatch):
    import harts.train.demo

    monkeypatch.setattr(harts.train.demo, "run_demo", lambda *a, **k: {"trajectories": 2, "loss_harts": float("nan")})
    result = CliRunner().invoke(app, ["run", "--json"])
    assert result.exit_code == USER_ERROR_EXIT
    assert "the step produced non-finite figures (loss_harts = nan)" in result.output and "NaN" not in result.output


def test_an_internal_failure_is_one_line_with_its_own_exit_code(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(harts, "compile", broken)
    result = CliRunner().invoke(app, ["compile", "demo", "-o", "unused.plan"])
    assert result.exit_code == INTERNAL_ERROR_EXIT
    assert "internal error: RuntimeError: something inside broke" in result.output and "Traceback" not in result.output
