"""Sizes read from untrusted files are bounded by what the file holds (issue 24): a node table's schema cannot
declare strings wider than the file, and a plan's tensors file must be exactly as large as its header says."""

from __future__ import annotations

import json
import os
import resource

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.errors import PlanArtifactError, RolloutInputError


def tagged_table(tmp_path, width: str):
    path = tmp_path / "t.jsonl"
    harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4]], tag=["a", "bb"]).write(path)
    lines = path.read_text().splitlines()
    schema = json.loads(lines[0])
    schema["trajectory_fields"]["tag"] = width
    del schema["content_hash"]
    path.write_text("\n".join([json.dumps(schema)] + lines[1:]) + "\n")
    return path


@pytest.mark.parametrize("width", ["<U20000000", "<U500000000", "<U100000"])
def test_a_schema_wider_than_the_file_is_refused_before_any_allocation(tmp_path, width):
    path = tagged_table(tmp_path, width)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(RolloutInputError, match=f"{path}: schema: field 'tag' declares strings of .* more than the whole file"):
        harts.RolloutBatch.read(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # KiB: nothing near the declared width


def test_a_schema_width_within_the_file_still_reads(tmp_path):
    batch = harts.RolloutBatch.read(tagged_table(tmp_path, "<U8"))
    assert batch.trajectory_fields["tag"].dtype.str == "<U8" and batch.trajectory_fields["tag"].tolist() == ["a", "bb"]


def plan_directory(tmp_path):
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3, 4], [1, 2, 5, 6]])
    path = tmp_path / "plan"
    harts.compile(batch, capacity=40, chunk_size=4).save(path)
    return path


def test_a_sparse_huge_tensors_file_is_refused_without_reading_it(tmp_path):
    path = plan_directory(tmp_path)
    tensors = path / "tensors.safetensors"
    os.truncate(tensors, 6 << 30)  # sparse: 6 GiB apparent, nothing on disk
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(PlanArtifactError, match="its header declares .* bytes of tensors but the file holds 6,44"):
        harts.load_plan(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # KiB


def test_a_single_file_plan_padded_at_the_end_is_refused(tmp_path):
    path = tmp_path / "plan.safetensors"
    harts.compile(harts.RolloutBatch.from_trajectories([[1, 2, 3]]), capacity=40, chunk_size=4).save(path)
    with path.open("ab") as handle:
        handle.write(b"\0" * 4096)
    with pytest.raises(PlanArtifactError, match="not a readable plan file .*header declares"):
        harts.load_plan(path)


@settings(max_examples=30, deadline=None)
@given(header=st.integers(0, 2**64 - 1))
def test_any_declared_header_length_gives_a_plan_error(tmp_path_factory, header):
    path = tmp_path_factory.mktemp("plan") / "plan.safetensors"
    path.write_bytes(header.to_bytes(8, "little") + b'{"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}')
    with pytest.raises(PlanArtifactError):
        harts.load_plan(path)
