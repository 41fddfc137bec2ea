"""``harts convert --from {verl,trl,areal} FILE -o TABLE``: saved framework batches become node tables."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

import harts
from harts.cli import app
from harts.interop import from_areal, from_trl, from_verl, read_framework_file
from tests.helpers import areal_rows, fixed_episodes, trl_batch, verl_batch

runner = CliRunner()


def episodes_and_values():
    episodes = fixed_episodes(seed=3)
    rng = np.random.default_rng(3)
    return episodes, [rng.normal(size=len(tokens) - 1) for tokens, _, _ in episodes]


def write_rows(path, columns):
    """One row per trajectory, as JSON Lines or Parquet."""
    count = len(next(iter(columns.values())))
    rows = [{k: (v[b].tolist() if hasattr(v[b], "tolist") else v[b]) for k, v in columns.items()} for b in range(count)]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


def convert(framework, source, output, *extra):
    return runner.invoke(app, ["convert", str(source), "--from", framework, "-o", str(output), *extra])


@pytest.mark.parametrize("suffix", [".pt", ".jsonl", ".parquet"])
def test_convert_verl_writes_the_batch_from_verl_reads(tmp_path, suffix):
    episodes, values = episodes_and_values()
    d = verl_batch(episodes, values)
    source = tmp_path / f"batch{suffix}"
    if suffix == ".pt":
        torch.save({k: torch.as_tensor(v) for k, v in d.items() if k != "uid"}, source)
        d = {k: v for k, v in d.items() if k != "uid"}
    else:
        write_rows(source, d)
    table = tmp_path / "table.parquet"
    result = convert("verl", source, table)
    assert result.exit_code == 0, result.output
    assert "trajectories" in result.output
    written = harts.RolloutBatch.read(table)
    assert written.content_hash() == from_verl(read_framework_file(source)).content_hash()
    # the values are verl's (JSON and Parquet rows carry no dtype: float32 comes back as float64, exactly)
    expected = from_verl(d)
    assert [t.tolist() for t in written.tokens] == [t.tolist() for t in expected.tokens]
    for name, arrays in expected.token_fields.items():
        assert all(np.array_equal(a, b) for a, b in zip(written.token_fields[name], arrays)), name
    assert written.trajectory_fields["prompt_length"].tolist() == [p for _, _, p in episodes]


@pytest.mark.parametrize("framework", ["trl", "areal"])
def test_convert_trl_and_areal_rows(tmp_path, framework):
    episodes, values = episodes_and_values()
    if framework == "trl":
        d = {k: v for k, v in trl_batch(episodes, values).items() if k != "num_items_in_batch"}
        importer = from_trl
    else:
        rows = areal_rows(episodes, values)
        d = {k: [r[k] for r in rows] for k in rows[0]}  # ragged rows: one unpadded trajectory each
        importer = from_areal
    source = tmp_path / "rows.jsonl"
    write_rows(source, d)
    table = tmp_path / "table.jsonl"
    extra, options = (("--not-rolled",), {"rolled": False}) if framework == "areal" else ((), {})
    result = convert(framework, source, table, *extra)
    assert result.exit_code == 0, result.output
    assert harts.RolloutBatch.read(table).content_hash() == importer(read_framework_file(source), **options).content_hash()
    if framework == "areal":  # whether compute_advantages rolled the batch is said, never guessed
        result = convert(framework, source, tmp_path / "other.jsonl")
        assert result.exit_code == 2 and "--rolled or --not-rolled" in result.output


def test_convert_refuses_foreign_outputs_and_names_bad_input(tmp_path):
    episodes, values = episodes_and_values()
    source = tmp_path / "batch.pt"
    torch.save({k: torch.as_tensor(v) for k, v in verl_batch(episodes, values).items() if k != "uid"}, source)
    mine = tmp_path / "notes.jsonl"
    mine.write_text('{"my": "data"}\n')
    result = convert("verl", source, mine)
    assert result.exit_code == 2 and "is not a node table HARTS wrote" in " ".join(result.output.split())
    assert mine.read_text() == '{"my": "data"}\n'
    table = tmp_path / "t.jsonl"
    assert convert("verl", source, table).exit_code == 0
    assert convert("verl", source, table).exit_code == 0  # our own table is replaced
    result = convert("verl", source, source)
    assert result.exit_code == 2 and f"that is {source}, an input of this run" in " ".join(result.output.split())
    result = convert("trl", source, tmp_path / "x.jsonl")
    assert result.exit_code == 2 and "missing required key 'prompt_ids'" in result.output and "batch.pt" in result.output
    result = convert("megatron", source, tmp_path / "x.jsonl")
    assert result.exit_code == 2 and "unknown framework" in result.output
    pickled = tmp_path / "object.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long), "meta": datetime.date(2025, 1, 1)}, pickled)
    result = convert("verl", pickled, tmp_path / "y.jsonl")
    assert result.exit_code == 2 and "read safely" in result.output
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "y.jsonl").exists()
