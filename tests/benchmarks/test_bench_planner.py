"""The planner benchmark (benchmarks/bench_planner.py) on two small steps: valid plans, tables, idempotent RESULTS update."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers import load_benchmark

pytest.importorskip("ortools")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_planner.py")


@pytest.fixture(scope="module")
def small_run(bench):
    args = argparse.Namespace(profile="calibrated", steps=2, scale=0.05, dp=[2], table2_dp=2, capacity=8192,
                              time_limit=0.3, workers=1, repeats=1)
    return bench.run(args)


def test_every_step_has_valid_plans_from_both_planners(small_run):
    assert [step["seed"] for step in small_run["steps"]] == [1, 2]
    for step in small_run["steps"]:
        entry = step["per_dp"][2]
        harts, ortools = entry["harts"], entry["ortools"]
        assert harts["microbatches"] % 2 == 0 and ortools["microbatches"] % 2 == 0
        assert step["lower_bound"] <= min(harts["compact"], entry["paper_only"]["compact"], ortools["compact"])
        assert len(harts["slot_imbalance"]) == harts["microbatches"] // 2
        assert harts["objective"][0] == harts["compact"]


def test_tables_name_the_profile_and_results_update_is_idempotent(bench, small_run, tmp_path):
    text = bench.render(small_run)
    assert text.startswith("## Microbatch planning (Tables 2-3), calibrated profile\n")
    assert "--profile calibrated --steps 2 --scale 0.05" in text
    assert "| 2 | " in text  # the Table 3 row for D = 2
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    bench.update_results(results, text, "notes\n")
    once = results.read_text()
    bench.update_results(results, text, "notes\n")
    assert results.read_text() == once
    assert once.count("calibrated profile") == 1 and "kept" in once and "notes" in once
    assert not list(tmp_path.glob("*.tmp"))


def test_the_shapes_mode_reports_time_and_work_per_shape_within_budget(bench, tmp_path):
    from harts.rollouts.workloads import grpo_step, no_sharing_step, wide_tree_step

    shapes = {
        "no-sharing": ("no shared prefix", lambda: no_sharing_step(trajectories=40, min_tokens=20, max_tokens=120)),
        "wide-tree": ("one wide tree", lambda: wide_tree_step(leaves=40, prompt_tokens=100, min_tokens=5, max_tokens=90)),
        "grpo": ("GRPO groups", lambda: grpo_step(groups=4, group_size=8, min_prompt=10, max_prompt=80, min_tokens=5, max_tokens=120)),
    }
    args = argparse.Namespace(shape_names=list(shapes), capacity=1024, shape_dp=2, repeats=1)
    result = bench.run_shapes(args, shapes)
    for row in result["shapes"]:
        assert row["objective"] <= row["paper_objective"]  # never worse than the paper's stages alone
        assert row["lower_bound"] <= row["objective"][0]
        for stage, used in row["work"].items():
            assert used <= row["work_limits"][stage] + 16 * row["paths"]
    text = bench.render_shapes(result)
    assert text.startswith("## Planning time and work per batch shape\n")
    assert "--shapes no-sharing wide-tree grpo --shape-dp 2 --capacity 1024 --repeats 1" in text
    assert text.count("\n| ") == 1 + len(shapes)  # the header and one row per shape
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Other\n\nkept\n")
    bench.update_results(results, text, "notes\n")
    once = results.read_text()
    bench.update_results(results, text, "notes\n")
    assert results.read_text() == once and "kept" in once
