"""Issue 24, item 6: ``--metrics`` records are appended whole or not at all.

Under a file-size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored, as a quota or a full disk would behave) a record that
does not fit used to stay half-written, and the next run's first record was glued onto it: both were lost. Now
the file is cut back to its last whole record, the run stops with one line naming ``--metrics`` and the path,
and the next run appends on a line of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from typer.testing import CliRunner

from harts.cli import USER_ERROR_EXIT, app
from harts.errors import OutputError
from harts.fsio import METRICS, METRICS_MARKER, RecordAppender, metrics_line
from harts.train.loop import MetricsFile
from tests.helpers import REPO, SMALL_MODEL, forked_batch

runner = CliRunner()

# Runs its arguments under a file-size limit: argv[1] is the limit in bytes, then either "cli" and the harts
# arguments, or "append", a path and a record count (the library's appender, without torch).
_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing us
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
what = sys.argv.pop(1)
if what == "cli":
    sys.argv[0] = "harts"
    from harts.cli import app
    app()
else:
    from harts.errors import OutputError
    from harts.fsio import METRICS, RecordAppender, metrics_line  # what MetricsFile does, without importing torch
    metrics = RecordAppender(sys.argv[1], METRICS, option="--metrics")
    try:
        for step in range(int(sys.argv[2])):
            metrics.append(metrics_line({"step": step, "loss": 0.25, "note": "x" * 300}))
    except OutputError as error:
        print(error)
        sys.exit(2)
"""


def run_limited(limit: int, *arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _LIMITED, str(limit), *arguments], cwd=cwd, capture_output=True, text=True,
                          env=environment, timeout=600)


def records_of(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("room", [0, 150], ids=["at the limit (EFBIG)", "half a record of room (short write)"])
def test_a_record_that_does_not_fit_is_cut_back_off(tmp_path, room):
    path = tmp_path / "m.jsonl"
    MetricsFile(path).write({"step": -1, "loss": 1.0})
    size = path.stat().st_size
    result = run_limited(size + room, "append", str(path), "3", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"--metrics {path}: cannot append a record" in result.stdout and "cut back to its last whole record" in result.stdout
    assert path.stat().st_size == size
    metrics = MetricsFile(path)  # the next run appends on a line of its own
    metrics.write({"step": 0, "loss": 0.5})
    metrics.close()
    assert [r["step"] for r in records_of(path)] == [-1, 0]


def test_records_that_fit_are_kept_and_only_the_one_that_does_not_is_dropped(tmp_path):
    path = tmp_path / "m.jsonl"
    record = metrics_line({"step": 0, "loss": 0.25, "note": "x" * 300})
    result = run_limited(2 * len(record) + len(record) // 2, "append", str(path), "5", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert [r["step"] for r in records_of(path)] == [0, 1]


def test_a_run_that_hits_the_limit_stops_with_one_line_and_the_next_run_appends_whole_records(tmp_path, monkeypatch, single_thread):
    table = tmp_path / "in.jsonl"
    forked_batch().write(table)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(dict(steps=2, epochs=1, dtype="float64", chunk_size=4, capacity=40, seed=3, model=SMALL_MODEL)))
    metrics = tmp_path / "m.jsonl"
    arguments = ("train", "in.jsonl", "--config", "run.yaml", "--metrics", "m.jsonl")
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, arguments).exit_code == 0
    size = metrics.stat().st_size
    first = records_of(metrics)
    result = run_limited(size + len(metrics.read_bytes().splitlines()[0]) // 2, "cli", *arguments, cwd=tmp_path)
    assert result.returncode == USER_ERROR_EXIT, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: --metrics m.jsonl: cannot append a record") and "Traceback" not in result.stderr
    assert metrics.stat().st_size == size and records_of(metrics) == first
    assert runner.invoke(app, arguments).exit_code == 0
    records = records_of(metrics)
    assert [r["step"] for r in records] == [1, 2, 1, 2] and all(METRICS_MARKER in r for r in records)


def test_a_record_cut_by_a_killed_run_is_followed_on_a_new_line(tmp_path):
    path = tmp_path / "m.jsonl"
    whole = metrics_line({"step": 1, "loss": 0.5})
    path.write_bytes(whole + whole[: len(whole) // 2])  # killed in the middle of the second write
    metrics = MetricsFile(path)
    metrics.write({"step": 2, "loss": 0.25})
    metrics.close()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["step"] == 1 and json.loads(lines[2])["step"] == 2
    MetricsFile(path).close()  # the fragment left on its own line keeps the file recognisably ours


def test_a_last_record_without_its_newline_is_not_glued_to_the_next(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(metrics_line({"step": 1, "loss": 0.5}).rstrip(b"\n"))
    appender = RecordAppender(path, METRICS)
    appender.append(metrics_line({"step": 2, "loss": 0.25}))
    appender.close()
    assert [r["step"] for r in records_of(path)] == [1, 2]


@pytest.mark.parametrize("content", [b"step,loss\n1,0.5\n", b'{"step": 1}\n', b"\x00" * 64, b'{"harts_metrics": "0.1.0", "step": 1}\nnot json\n'])
def test_a_file_that_is_not_harts_metrics_is_not_appended_to(tmp_path, content):
    path = tmp_path / "m.jsonl"
    path.write_bytes(content)
    with pytest.raises(OutputError, match="is not a HARTS metrics file"):
        MetricsFile(path, option="--metrics")
    assert path.read_bytes() == content
