"""harts.load_plan on damaged, foreign or unreadable artifacts: always PlanArtifactError naming the path, never a
raw Python error and never a wrong plan (property test over corrupted bytes of every artifact file)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts
from harts.errors import PlanArtifactError
from tests.helpers import corrupt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A compiled demo-sized plan saved both as a directory and as a single file."""
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [1, 2, 3, 4, 5, 8], [4, 4, 4]])
    plan = harts.compile(batch, capacity=16, dp_size=2, chunk_size=2)
    root = tmp_path_factory.mktemp("plans")
    plan.save(root / "plan")
    plan.save(root / "plan.safetensors")
    return plan, root


def same_plan(loaded, plan) -> bool:
    tensors, expected = loaded.index_tensors(), plan.index_tensors()
    return (loaded.ir_text() == plan.ir_text() and loaded.pipeline == plan.pipeline
            and {k: v for k, v in loaded.stats.items() if k != "plan_seconds"} == {k: v for k, v in plan.stats.items() if k != "plan_seconds"}
            and tensors.keys() == expected.keys() and all(np.array_equal(tensors[k], expected[k]) for k in tensors))


DAMAGED_MANIFESTS = {
    "not UTF-8": (b"\xff\xfe\x00{", "manifest.json: truncated or not JSON"),
    "garbage": (b"{this is not json", "manifest.json: truncated or not JSON"),
    "a JSON list": (b"[1, 2, 3]", "the manifest is not a JSON object"),
    "deep nesting": (b"[" * 100_000, "manifest.json: truncated or not JSON"),
    "empty": (b"", "manifest.json: truncated or not JSON"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_MANIFESTS))
def test_a_damaged_manifest_is_named(saved, tmp_path, case):
    _, root = saved
    target = tmp_path / "plan"
    shutil.copytree(root / "plan", target)
    content, message = DAMAGED_MANIFESTS[case]
    (target / "manifest.json").write_bytes(content)
    with pytest.raises(PlanArtifactError) as error:
        harts.load_plan(target)
    assert message in str(error.value) and str(target) in str(error.value)


def test_manifest_entries_of_the_wrong_type_and_unreadable_parts_are_named(saved, tmp_path):
    from harts.plan import _manifest_digest

    _, root = saved
    target = tmp_path / "plan"
    shutil.copytree(root / "plan", target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["stats"] = [1, 2]
    manifest["manifest_sha256"] = _manifest_digest(manifest)  # a consistent but foreign manifest
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PlanArtifactError, match="stats or pipeline_text has the wrong type"):
        harts.load_plan(target)
    shutil.rmtree(target)
    shutil.copytree(root / "plan", target)
    (target / "plan.ir").write_bytes(b"\xff" * 10)
    with pytest.raises(PlanArtifactError, match=rf"{target}: damaged plan \(a text part is not UTF-8\)"):
        harts.load_plan(target)
    (target / "plan.ir").unlink()
    (target / "plan.ir").mkdir()
    with pytest.raises(PlanArtifactError, match="cannot read the plan"):
        harts.load_plan(target)
    (target / "plan.ir").rmdir()
    with pytest.raises(PlanArtifactError, match="missing plan.ir"):
        harts.load_plan(target)
    stray = tmp_path / "notes.txt"
    stray.write_text("not a plan")
    with pytest.raises(PlanArtifactError, match=rf"{stray}: not a readable plan file"):
        harts.load_plan(stray)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(part=st.sampled_from(["manifest.json", "plan.ir", "tensors.safetensors", "single"]),
       how=st.sampled_from(["flip", "truncate", "insert", "delete"]), position=st.integers(0, 1 << 20), value=st.integers(0, 255))
def test_corrupted_artifacts_load_as_the_same_plan_or_fail_cleanly(saved, tmp_path_factory, part, how, position, value):
    plan, root = saved
    work = tmp_path_factory.mktemp("damaged")
    if part == "single":
        target = work / "plan.safetensors"
        shutil.copy(root / "plan.safetensors", target)
        damaged = target
    else:
        target = work / "plan"
        shutil.copytree(root / "plan", target)
        damaged = target / part
    damaged.write_bytes(corrupt(damaged.read_bytes(), how, position, value))
    try:
        loaded = harts.load_plan(target)
    except PlanArtifactError as error:
        assert str(target) in str(error)
        return
    assert same_plan(loaded, plan)
