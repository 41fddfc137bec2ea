"""harts.viz and ``harts inspect PLAN --plot DIR``: the figures exist, and the numbers they plot are the plan's.

The data functions are checked against the plan's IR and its inspect document computed
independently here; the PNG files are checked for their signature, size and pixel dimensions.
"""

from __future__ import annotations

import functools

import matplotlib.image
import pytest
from typer.testing import CliRunner

import harts
from harts.cli import app
from harts.errors import PlanArtifactError
from harts.viz import plan_histograms, segment_tree, slot_work, write_plots
from harts.rollouts.inputs import resolve_input

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@functools.lru_cache(maxsize=None)
def demo_plan():
    return harts.compile(resolve_input("demo"), capacity=1300, dp_size=2, chunk_size=16)


def test_slot_work_is_the_work_of_each_replica_in_each_slot():
    plan = demo_plan()
    data = slot_work(plan)
    document = plan.to_json()
    assert data.work.sum() == plan.stats["total_work"]
    for mb in document["microbatches"]:
        assert data.work[mb["replica"], mb["slot"]] == mb["compact_work"]
        assert data.microbatch[mb["replica"], mb["slot"]] == mb["index"]
    for slot in range(data.work.shape[1]):
        works = [mb["compact_work"] for mb in document["microbatches"] if mb["slot"] == slot]
        assert data.imbalance[slot] == pytest.approx(max(works) / (sum(works) / plan.module.dp_size))
    assert data.replica_totals.max() == plan.stats["max_replica_work"]
    assert data.work.max(axis=0).sum() == plan.stats["slot_critical_work"]


def test_segment_tree_rounds_and_replay_come_from_the_rounds():
    plan = demo_plan()
    for mb in plan.microbatches:
        tree = segment_tree(plan, mb.index)
        document = plan.to_json()["microbatches"][mb.index]
        assert tree.tokens.sum() == mb.work
        assert sum(r for _, _, r in tree.side_branches) == document["replay_tokens"]
        sequences = [s for r in document["rounds"] for s in r]
        assert len(tree.side_branches) == sum(1 for s in sequences if s["start"] > 0)
        assert len(tree.continuation) == len(mb.segments) - len(sequences)
        for number, rnd in enumerate(mb.rounds):
            for sequence in rnd.sequences:
                assert all(tree.round[s] == number for s in sequence.segments)
        for parent, child, replay in tree.side_branches:
            assert mb.segments[child].parent == parent and 0 <= replay < plan.module.chunk_size


def test_histograms_count_forks_side_branches_and_microbatches():
    plan = demo_plan()
    data = plan_histograms(plan)
    assert sorted(data["compact_work"].tolist()) == sorted(mb.work for mb in plan.microbatches)
    assert data["replay_per_fork"].sum() == plan.stats["replay_tokens"]
    forks = []
    for mb in plan.microbatches:
        for segment in mb.segments:
            children = [s for s in mb.segments if s.parent == segment.id]
            if len(children) > 1:
                forks.append(segment.end)
                assert all(child.start == segment.end for child in children)
    assert sorted(data["fork_depth"].tolist()) == sorted(forks)


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, path
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 200 and width > 300, path


def test_inspect_plot_writes_readable_pngs(tmp_path):
    plan_path = tmp_path / "demo.plan"
    demo_plan().save(plan_path)
    result = CliRunner().invoke(app, ["inspect", str(plan_path), "--plot", str(tmp_path / "plots"), "--microbatch", "2"])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["histograms.png", "segment_tree_mb2.png", "slot_work.png"]
    for name in names:
        _assert_png(tmp_path / "plots" / name)
    result = CliRunner().invoke(app, ["inspect", str(plan_path), "--plot", str(tmp_path / "p2"), "--microbatch", "99"])
    assert result.exit_code == 2 and "no microbatch 99" in result.output


def test_plots_need_a_rounded_plan(tmp_path):
    plan = harts.compile(resolve_input("demo"), capacity=4096, chunk_size=16, pipeline="prefix-compress,partition-microbatches")
    with pytest.raises(PlanArtifactError, match="phase"):
        write_plots(plan, tmp_path)
    assert not list(tmp_path.iterdir())
