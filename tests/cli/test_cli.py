"""The command line: compile, inspect, passes, and error reporting."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from harts.cli import app

runner = CliRunner()


def test_compile_then_inspect_json(tmp_path):
    plan = tmp_path / "demo.plan"
    result = runner.invoke(app, ["compile", "demo", "-o", str(plan), "--chunk-size", "16", "--capacity", "4096", "--dp", "2", "--time-passes"])
    assert result.exit_code == 0, result.output
    assert "compression" in result.output and "min-call-rounds" in result.output
    result = runner.invoke(app, ["inspect", str(plan), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["stats"]["dp_size"] == 2
    assert document["stats"]["num_microbatches"] % 2 == 0
    assert {mb["replica"] for mb in document["microbatches"]} == {0, 1}
    result = runner.invoke(app, ["inspect", str(plan)])
    assert result.exit_code == 0 and "microbatches" in result.output
    result = runner.invoke(app, ["inspect", str(plan), "--ir"])
    assert result.stdout.startswith("Module(")


def test_compile_dumps_every_stage_and_the_programs(tmp_path):
    dump = tmp_path / "ir"
    result = runner.invoke(app, ["compile", "demo", "-o", str(tmp_path / "p"), "--chunk-size", "16", "--capacity", "4096", "--dump-ir", str(dump)])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in dump.iterdir())
    assert names == ["000_lower.txt", "001_prefix-compress.txt", "002_partition-microbatches.txt", "003_schedule-slots.txt",
                     "004_segment.txt", "005_min-call-rounds.txt", "006_lay-out.txt"]
    assert "def forward" in (dump / "006_lay-out.txt").read_text()


def test_compile_with_a_partial_pipeline_and_print_ir(tmp_path):
    result = runner.invoke(app, ["compile", "demo", "-o", str(tmp_path / "p"), "--pipeline", "prefix-compress", "--print-ir-after-all"])
    assert result.exit_code == 0, result.output
    assert "IR after prefix-compress" in result.output


def test_errors_are_reported_without_a_traceback(tmp_path):
    result = runner.invoke(app, ["compile", "no-such-preset", "-o", str(tmp_path / "p")])
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["compile", "demo", "-o", str(tmp_path / "p"), "--pipeline", "prefix-compress,bogus"])
    assert result.exit_code == 2 and "unknown pass 'bogus'" in result.output
    result = runner.invoke(app, ["inspect", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "no plan at" in result.output
    assert not (tmp_path / "p").exists(), "a failed compile writes nothing"


def test_passes_lists_the_default_pipeline():
    result = runner.invoke(app, ["passes"])
    assert result.exit_code == 0
    assert "prefix-compress,partition-microbatches,schedule-slots,segment,min-call-rounds" in result.output.replace("\n", "")
