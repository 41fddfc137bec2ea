"""Saving a plan never deletes or half-writes what is at the target (issue: data loss on save)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import harts
from harts.cli import app
from harts.errors import PlanArtifactError
from harts.fsio import remove_stale_temporaries, temporary_prefix

runner = CliRunner()

TRAJECTORIES = [list(range(1, 20)) + [30, 31, 32], list(range(1, 20)) + [40, 41], [60, 61, 62, 63]]


def compile_plan(pipeline: str | None = None):
    batch = harts.RolloutBatch.from_trajectories(TRAJECTORIES, advantages=[0.5, -0.5, 1.0])
    return harts.compile(batch, capacity=40, dp_size=1, chunk_size=8, pipeline=pipeline)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (directories as None) with its bytes."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_directory_of_user_files_is_refused_and_left_untouched(tmp_path):
    target = tmp_path / "results"
    (target / "nested").mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    (target / "nested" / "data.bin").write_bytes(b"\x00\x01")
    before = snapshot(tmp_path)
    with pytest.raises(PlanArtifactError, match=r"results: it exists and is not a HARTS plan .*notes\.txt.*left untouched"):
        compile_plan().save(target)
    assert snapshot(tmp_path) == before


def test_the_cli_refuses_to_write_over_the_directory_holding_its_input(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    table = folder / "rollouts.jsonl"
    harts.rollouts.write_node_table(harts.RolloutBatch.from_trajectories(TRAJECTORIES), table)
    before = snapshot(tmp_path)
    result = runner.invoke(app, ["compile", str(table), "-o", str(folder), "--capacity", "64", "--chunk-size", "8"])
    assert result.exit_code != 0
    output = " ".join(result.output.split())
    assert f"--output {folder}: it holds {table}, an input of this run" in output
    assert snapshot(tmp_path) == before
    assert harts.RolloutBatch.read(table).tokens[0].tolist() == TRAJECTORIES[0]


def test_stray_files_inside_a_plan_directory_block_the_overwrite(tmp_path):
    target = compile_plan().save(tmp_path / "plan")
    (target / "stray.txt").write_text("someone's notes")
    before = snapshot(tmp_path)
    with pytest.raises(PlanArtifactError, match="stray.txt"):
        compile_plan(pipeline="prefix-compress").save(target)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["plan", "plan.safetensors"])
def test_a_regular_file_that_is_not_a_plan_is_refused(tmp_path, name):
    target = tmp_path / name
    target.write_bytes(b"user bytes, not a plan")
    with pytest.raises(PlanArtifactError, match="not a HARTS plan|it exists and is not a directory"):
        compile_plan().save(target)
    assert target.read_bytes() == b"user bytes, not a plan"


def test_a_single_file_plan_target_that_is_a_directory_is_refused(tmp_path):
    target = tmp_path / "plan.safetensors"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(PlanArtifactError, match="is a directory"):
        compile_plan().save(target)
    assert (target / "keep").read_text() == "x"


@pytest.mark.parametrize("name", ["plan", "plan.safetensors"])
def test_overwriting_a_plan_replaces_it_and_leaves_no_temporaries(tmp_path, name):
    target = tmp_path / name
    compile_plan().save(target)
    compile_plan(pipeline="prefix-compress").save(target)
    assert harts.load_plan(target).stats["phase"] == "compressed"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_an_empty_directory_may_receive_a_plan(tmp_path):
    target = tmp_path / "plan"
    target.mkdir()
    compile_plan().save(target)
    assert harts.load_plan(target).has_rounds


def test_saves_respect_the_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        directory = compile_plan().save(tmp_path / "plan")
        single = compile_plan().save(tmp_path / "plan.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()} == {0o640}
    assert stat.S_IMODE(single.stat().st_mode) == 0o640


def test_stale_temporaries_of_dead_writers_are_removed_on_the_next_save(tmp_path):
    target = tmp_path / "plan"
    stale_dir = tmp_path / f"{temporary_prefix(target)}{dead_pid()}-deadbeef"
    stale_dir.mkdir()
    (stale_dir / "manifest.json").write_text("{partial")
    live = tmp_path / f"{temporary_prefix(target)}{os.getppid()}-cafecafe"  # a writer that still runs
    live.mkdir()
    unrelated = tmp_path / ".plan.something-else"
    unrelated.mkdir()
    compile_plan().save(target)
    assert not stale_dir.exists()
    assert live.exists() and unrelated.exists()
    assert remove_stale_temporaries(target) == []


def test_a_failure_after_staging_leaves_the_old_plan_in_place(tmp_path, monkeypatch):
    target = compile_plan().save(tmp_path / "plan")
    before = snapshot(target)

    def refuse(*_args, **_kwargs):
        raise KeyboardInterrupt  # as if the process were stopped just before the swap

    monkeypatch.setattr("harts.fsio._exchange", refuse)
    with pytest.raises(KeyboardInterrupt):
        compile_plan(pipeline="prefix-compress").save(target)
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def _cli_compile(output: Path, capacity: int) -> list[str]:
    return ["-m", "harts", "compile", "demo", "-o", str(output), "--chunk-size", "16", "--capacity", str(capacity)]


# Runs the real CLI, but stops at one instant of the save (just before or just after the
# directory swap) and says so on stdout, so the test can SIGKILL it exactly there.
_PAUSING_CLI = """
import sys, time
import harts.fsio as fsio
where = sys.argv.pop(1)
swap = fsio._exchange
def pausing_exchange(first, second):
    if where == "before":
        print("PAUSED", flush=True); time.sleep(600)
    done = swap(first, second)
    if where == "after":
        print("PAUSED", flush=True); time.sleep(600)
    return done
fsio._exchange = pausing_exchange
sys.argv[0] = "harts"
from harts.cli import app
app()
"""


def _work_at(target: Path) -> int:
    return harts.load_plan(target).stats["total_work"]


@pytest.mark.parametrize("instant", ["before", "after"])
def test_the_cli_killed_at_the_swap_leaves_a_whole_plan_and_the_next_save_cleans_up(tmp_path, instant):
    target = tmp_path / "demo.plan"
    subprocess.run([sys.executable, *_cli_compile(target, 2048)], check=True, capture_output=True)
    old = _work_at(target)
    process = subprocess.Popen([sys.executable, "-c", _PAUSING_CLI, instant, *_cli_compile(target, 4096)[2:]],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "PAUSED" in (line.strip() for line in process.stdout), "the CLI ended without reaching the swap"
    finally:
        process.kill()
        process.wait()
    leftovers = [p for p in tmp_path.iterdir() if p.name != "demo.plan"]
    assert leftovers and all(p.name.startswith(temporary_prefix(target)) for p in leftovers)
    # killed before the swap: the old plan; after it: the new one; never a missing or partial plan
    assert (_work_at(target) == old) == (instant == "before")
    subprocess.run([sys.executable, *_cli_compile(target, 2048)], check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.plan"]
    assert _work_at(target) == old


@pytest.mark.slow
def test_killing_the_cli_at_delays_spread_over_an_overwrite_always_leaves_a_whole_plan(tmp_path):
    target = tmp_path / "demo.plan"
    subprocess.run([sys.executable, *_cli_compile(target, 4096)], check=True, capture_output=True)
    started = time.perf_counter()
    subprocess.run([sys.executable, *_cli_compile(target, 2048)], check=True, capture_output=True)
    duration = time.perf_counter() - started
    either = {_work_at(target)}
    subprocess.run([sys.executable, *_cli_compile(target, 4096)], check=True, capture_output=True)
    either.add(_work_at(target))
    for attempt in range(10):
        process = subprocess.Popen([sys.executable, *_cli_compile(target, 4096 if attempt % 2 else 2048)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(duration * (0.55 + 0.05 * attempt))
        process.kill()
        process.wait()
        assert _work_at(target) in either
    subprocess.run([sys.executable, *_cli_compile(target, 4096)], check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.plan"]


def test_two_first_saves_of_one_new_plan_directory_at_once_both_succeed(tmp_path, monkeypatch):
    """Issue 24: concurrent first saves sometimes failed with "Directory not empty": both saw no target, and the
    second rename landed on the directory the first had just created. Here the other save runs exactly in that gap."""
    target = tmp_path / "plan"
    real_rename = os.rename
    raced = []

    def rename_after_another_save(source, destination):
        if Path(destination) == target and not raced:
            raced.append(True)
            compile_plan(pipeline="prefix-compress").save(target)  # the other writer wins the race
            assert target.is_dir()
        return real_rename(source, destination)

    monkeypatch.setattr(os, "rename", rename_after_another_save)
    compile_plan().save(target)
    assert raced
    assert harts.load_plan(target).has_rounds  # the later save replaced the earlier, as for any existing plan
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_a_user_directory_that_appears_during_a_first_save_is_left_untouched(tmp_path, monkeypatch):
    target = tmp_path / "plan"
    real_rename = os.rename

    def rename_after_the_user_creates_it(source, destination):
        if Path(destination) == target and not target.exists():
            target.mkdir()
            (target / "notes.txt").write_text("mine")
        return real_rename(source, destination)

    monkeypatch.setattr(os, "rename", rename_after_the_user_creates_it)
    with pytest.raises(PlanArtifactError, match="notes.txt"):
        compile_plan().save(target)
    assert snapshot(tmp_path) == {"plan": None, "plan/notes.txt": b"mine"}
