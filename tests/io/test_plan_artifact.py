"""Plan artifacts: byte-identical saves, atomic writes, and clear errors for damaged files."""

from __future__ import annotations

import json

import pytest

import harts
from harts.errors import PlanArtifactError
from harts.plan import SCHEMA_VERSION

TRAJECTORIES = [
    list(range(1, 20)) + [30, 31, 32],
    list(range(1, 20)) + [40, 41],
    list(range(1, 9)) + [50, 51, 52, 53, 54, 55, 56, 57, 58],
    [60, 61, 62, 63],
    list(range(1, 20)),
]


def compile_plan(**options):
    batch = harts.RolloutBatch.from_trajectories(TRAJECTORIES, advantages=[0.5, -0.5, 1.0, 0.0, 0.25])
    return harts.compile(batch, capacity=40, dp_size=2, chunk_size=8, **options)


def files_of(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_input_and_options_give_byte_identical_artifacts(tmp_path):
    first = compile_plan().save(tmp_path / "a")
    second = compile_plan().save(tmp_path / "b")
    assert files_of(first) == files_of(second)
    single_a = compile_plan().save(tmp_path / "a.safetensors")
    single_b = compile_plan().save(tmp_path / "b.safetensors")
    assert single_a.read_bytes() == single_b.read_bytes()


@pytest.mark.parametrize("name", ["plan", "plan.safetensors"])
def test_round_trip_keeps_ir_stats_and_json(tmp_path, name):
    plan = compile_plan()
    loaded = harts.load_plan(plan.save(tmp_path / name))
    assert loaded.module == plan.module
    assert loaded.pipeline == plan.pipeline
    expected = plan.to_json()
    actual = loaded.to_json()
    expected["stats"].pop("plan_seconds")
    assert actual["stats"].pop("plan_seconds") is None
    assert actual == expected
    assert loaded.index_tensors().keys() == plan.index_tensors().keys()


def test_saving_over_an_existing_plan_replaces_it_whole(tmp_path):
    target = tmp_path / "plan"
    compile_plan().save(target)
    compile_plan(pipeline="prefix-compress").save(target)
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json", "plan.ir", "tensors.safetensors"]
    assert harts.load_plan(target).stats["phase"] == "compressed"


def test_truncated_files_are_rejected(tmp_path):
    path = compile_plan().save(tmp_path / "plan")
    for name, message in [("tensors.safetensors", "truncated or edited"), ("plan.ir", "IR was truncated or edited"), ("manifest.json", "truncated or not JSON")]:
        original = (path / name).read_bytes()
        (path / name).write_bytes(original[: len(original) // 2])
        with pytest.raises(PlanArtifactError, match=message):
            harts.load_plan(path)
        (path / name).write_bytes(original)
    harts.load_plan(path)


def test_edited_manifest_and_ir_are_rejected(tmp_path):
    path = compile_plan().save(tmp_path / "plan")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["stats"]["total_work"] += 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PlanArtifactError, match="manifest was edited"):
        harts.load_plan(path)

    path = compile_plan().save(tmp_path / "plan2")
    ir = (path / "plan.ir").read_text().replace("multiplicity=1", "multiplicity=2", 1)
    (path / "plan.ir").write_text(ir)
    with pytest.raises(PlanArtifactError, match="IR was truncated or edited"):
        harts.load_plan(path)


def test_other_schema_versions_are_rejected(tmp_path):
    from harts.plan import _manifest_digest

    path = compile_plan().save(tmp_path / "plan")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["schema_version"] = SCHEMA_VERSION + 1
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PlanArtifactError, match=f"schema version {SCHEMA_VERSION + 1} is not supported"):
        harts.load_plan(path)


def test_single_file_damage_is_rejected(tmp_path):
    path = compile_plan().save(tmp_path / "plan.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(PlanArtifactError):
        harts.load_plan(path)
    (tmp_path / "other.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(PlanArtifactError, match="not a readable plan file"):
        harts.load_plan(tmp_path / "other.safetensors")


def test_missing_plan_is_named(tmp_path):
    with pytest.raises(PlanArtifactError, match="no plan at"):
        harts.load_plan(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlanArtifactError, match="missing manifest.json"):
        harts.load_plan(tmp_path / "empty")


def test_inspect_document_has_the_design_keys():
    document = compile_plan().to_json()
    for key in ("trajectories", "semantic_tokens", "compact_tokens", "compression", "lower_bound_work", "total_work",
                "slot_critical_work", "max_replica_work", "num_microbatches", "dp_size", "capacity", "chunk_size",
                "replay_tokens", "max_rounds", "plan_seconds", "trees", "max_depth", "segments"):
        assert key in document["stats"], key
    covered = sorted(i for mb in document["microbatches"] for i in mb["trajectories"])
    assert covered == list(range(len(TRAJECTORIES)))
    for mb in document["microbatches"]:
        assert set(mb) >= {"replica", "slot", "trajectories", "compact_work", "replay_tokens", "rounds"}
        for round_ in mb["rounds"]:
            for sequence in round_:
                assert set(sequence) >= {"trajectory", "start", "end", "replay_start", "state_from"}
