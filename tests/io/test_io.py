"""Node tables: reading, writing (exact round trips, atomic writes) and input validation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts.rollouts.nodetable.write as node_table_writer
from harts import RolloutBatch
from harts.errors import RolloutInputError
from harts.rollouts import node_table_records, read_node_table, read_node_table_records, write_node_table
from tests.helpers import assert_identical, node, small_batch, trajectory

SUFFIXES = (".jsonl", ".parquet")


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trip_keeps_everything(tmp_path, suffix):
    batch = small_batch()
    path = tmp_path / f"batch{suffix}"
    write_node_table(batch, path)
    assert_identical(read_node_table(path), batch)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_batch_read_and_write_delegate_to_io(tmp_path, suffix):
    batch = small_batch()
    path = tmp_path / f"batch{suffix}"
    batch.write(path)
    assert_identical(RolloutBatch.read(path), batch)


def test_written_nodes_split_where_per_token_values_differ():
    records = node_table_records(small_batch())
    nodes = [r for r in records if r["kind"] == "node" and r["tree_id"] == 0]
    # Tree 0: [1] is shared by every trajectory; [2] splits by loss mask (0 vs 1), then [3]
    # forks into [4] and [5, 6].
    assert sorted(tuple(n["token_ids"]) for n in nodes) == [(1,), (2,), (2, 3), (4,), (5, 6)]
    by_id = {n["node_id"]: n for n in nodes}
    leaves = {r["trajectory_id"]: r["leaf"] for r in records if r["kind"] == "trajectory"}
    assert by_id[leaves[3]]["token_ids"] == [2] and by_id[leaves[3]]["loss_mask"] == [1.0]
    assert [by_id[leaves[i]]["token_ids"] for i in (0, 2)] == [[4], [5, 6]]
    assert records[0]["kind"] == "schema"


def test_written_tree_without_tree_ids_groups_by_first_token(tmp_path):
    batch = RolloutBatch(tokens=(np.array([5, 6]), np.array([5, 7]), np.array([8])), token_fields={}, tree_ids=None)
    path = tmp_path / "b.jsonl"
    write_node_table(batch, path)
    read = read_node_table(path)
    np.testing.assert_array_equal(read.tree_ids, [0, 0, 1])
    assert [t.tolist() for t in read.tokens] == [[5, 6], [5, 7], [8]]


def test_nodes_only_table_makes_one_trajectory_per_leaf_in_node_order():
    batch = read_node_table_records(
        [
            node(7, 0, None, [1, 2, 3]),
            node(7, 2, 0, [5, 6]),
            node(7, 1, 0, [4]),
            node(3, 10, None, [9]),
        ]
    )
    assert [t.tolist() for t in batch.tokens] == [[1, 2, 3, 5, 6], [1, 2, 3, 4], [9]]
    assert batch.tree_ids.tolist() == [7, 7, 3]
    assert batch.loss_mask[0].dtype == np.float32
    assert [m.tolist() for m in batch.loss_mask] == [[1, 1, 1, 1, 1], [1, 1, 1, 1], [1]]
    assert batch.trajectory_fields == {}
    assert set(batch.token_fields) == {"loss_mask"}


def test_logprobs_column_becomes_rollout_logprobs():
    batch = read_node_table_records(
        [node(0, 0, None, [1, 2], logprobs=[-0.5, -1.5]), node(0, 1, 0, [3], logprobs=[-2.0])]
    )
    assert batch.token_fields["rollout_logprobs"][0].tolist() == [-0.5, -1.5, -2.0]


def test_interior_leaf_and_trajectory_ids_set_the_order():
    records = [
        node(0, 0, None, [1, 2], loss_mask=[1, 1]),
        node(0, 1, 0, [3, 4], loss_mask=[0, 1]),
        node(0, 2, 1, [5], loss_mask=[1]),
        trajectory(0, 2, trajectory_id=4, reward=1.0, group_id=0),
        trajectory(0, 0, trajectory_id=1, reward=0.0, group_id=0),  # a prefix of the other
        trajectory(0, 1, trajectory_id=2, reward=0.5, group_id=0),
    ]
    batch = read_node_table_records(records)
    assert [t.tolist() for t in batch.tokens] == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert batch.trajectory_fields["reward"].tolist() == [0.0, 0.5, 1.0]
    assert batch.trajectory_fields["group_id"].dtype == np.int64
    assert batch.loss_mask[2].tolist() == [1, 1, 0, 1, 1]


def test_order_of_appearance_without_trajectory_ids():
    records = [
        node(1, 0, None, [7]),
        node(0, 0, None, [1]),
        node(0, 1, 0, [2]),
        node(0, 2, 0, [3]),
        trajectory(0, 2),
        trajectory(0, 1),
    ]
    batch = read_node_table_records(records)
    # Tree 1 has no trajectory rows: its leaf (record 0) comes first.
    assert [t.tolist() for t in batch.tokens] == [[7], [1, 3], [1, 2]]
    assert batch.tree_ids.tolist() == [1, 0, 0]


def test_empty_root_node_and_multiple_roots_are_allowed():
    records = [node(0, 0, None, []), node(0, 1, 0, [4, 5]), node(0, 2, None, [6])]
    batch = read_node_table_records(records)
    assert [t.tolist() for t in batch.tokens] == [[4, 5], [6]]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_hand_written_tables_read_the_same_from_both_formats(tmp_path, suffix):
    records = [
        node(0, 0, None, [1, 2], loss_mask=[0, 0]),
        node(0, 1, 0, [3], loss_mask=[1]),
        node(0, 2, 0, [4, 5], loss_mask=[1, 0]),
        trajectory(0, 2, reward=1.0),
        trajectory(0, 1, reward=0.0),
    ]
    path = tmp_path / f"hand{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        columns = {key: [r.get(key) for r in records] for key in dict.fromkeys(k for r in records for k in r)}
        pq.write_table(pa.table(columns), path)
    batch = read_node_table(path)
    assert [t.tolist() for t in batch.tokens] == [[1, 2, 4, 5], [1, 2, 3]]
    assert [m.tolist() for m in batch.loss_mask] == [[0, 0, 1, 0], [0, 0, 1]]
    assert batch.trajectory_fields["reward"].tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- validation

BASE = [node(0, 0, None, [1, 2]), node(0, 1, 0, [3]), node(0, 2, 0, [4])]

INVALID_TABLES = {
    "missing parent": (
        [node(0, 0, None, [1]), node(0, 1, 5, [2])],
        "tree 0, node 1: parent_id 5 is not a node of tree 0",
    ),
    "parent in another tree": (
        [node(0, 0, None, [1]), node(1, 1, 0, [2])],
        "tree 1, node 1: parent_id 0 is not a node of tree 1",
    ),
    "cycle": (
        [node(0, 0, None, [1]), node(0, 1, 2, [2]), node(0, 2, 1, [3])],
        "tree 0: parent_id links form a cycle: node 1 -> node 2 -> node 1",
    ),
    "self parent": ([node(3, 4, 4, [1])], "tree 3: parent_id links form a cycle: node 4 -> node 4"),
    "duplicate node id": (
        [node(0, 0, None, [1]), node(0, 0, None, [2])],
        "tree 0: duplicate node_id 0 (records 0 and 1)",
    ),
    "duplicate trajectory id": (
        BASE + [trajectory(0, 1, trajectory_id=0), trajectory(0, 2, trajectory_id=0)],
        "trajectory 0: duplicate trajectory_id (records 3 in tree 0 and 4 in tree 0)",
    ),
    "trajectory id on some rows only": (
        BASE + [trajectory(0, 1, trajectory_id=0), trajectory(0, 2)],
        "tree 0, trajectory at record 4: trajectory_id is given on some trajectory rows but not on this one",
    ),
    "leaf missing": (
        BASE + [trajectory(0, 9, trajectory_id=3)],
        "tree 0, trajectory 3: leaf 9 is not a node of tree 0",
    ),
    "leaf in unknown tree": (BASE + [trajectory(5, 0)], "tree 5, trajectory at record 3: leaf 0 is not a node of tree 5"),
    "empty trajectory": (
        [node(0, 0, None, []), node(0, 1, 0, []), trajectory(0, 1, trajectory_id=2)],
        "tree 0, trajectory 2: empty trajectory (no node on the path from the root to node 1 has tokens)",
    ),
    "empty implied trajectory": (
        [node(0, 0, None, [])],
        "tree 0, trajectory at leaf node 0: empty trajectory",
    ),
    "loss mask length": (
        [node(0, 0, None, [1, 2], loss_mask=[1])],
        "tree 0, node 0: field 'loss_mask' has 1 entries, expected 2 (one per token in 'token_ids')",
    ),
    "logprobs length": (
        [node(0, 0, None, [1], logprobs=[0.0]), node(0, 1, 0, [2, 3], logprobs=[-1.0, -2.0, -3.0])],
        "tree 0, node 1: field 'logprobs' has 3 entries, expected 2",
    ),
    "per-token field not a list": (
        [node(0, 0, None, [1], loss_mask=1)],
        "tree 0, node 0: field 'loss_mask' must be a list with one value per token, got 1",
    ),
    "per-token field not numeric": (
        [node(0, 0, None, [1, 2], weight=[1.0, "x"])],
        "tree 0, node 0: field 'weight' holds values of several types (float, str); values must be numbers or booleans",
    ),
    "float token": ([node(0, 3, None, [1, 2.5])], "tree 0, node 3: column 'token_ids' entry 1 is 2.5, not an integer token id"),
    "string token": ([node(0, 3, None, ["7"])], "tree 0, node 3: column 'token_ids' entry 0 is '7', not an integer token id"),
    "bool token": ([node(0, 3, None, [True])], "tree 0, node 3: column 'token_ids' entry 0 is True, not an integer token id"),
    "negative token": ([node(2, 3, None, [4, -1])], "tree 2, node 3: column 'token_ids' entry 1 is -1, token ids must be >= 0"),
    "huge token": ([node(2, 3, None, [2**32])], "tree 2, node 3: column 'token_ids' entry 0 is 4294967296, above the largest id"),
    "token ids not a list": ([node(0, 0, None, 5)], "tree 0, node 0: column 'token_ids' must be a list of token ids, got 5"),
    "unknown kind": ([{"kind": "edge", "tree_id": 0}], "record 0: unknown kind 'edge'; expected 'node' or 'trajectory'"),
    "missing kind": ([{"tree_id": 0, "node_id": 0}], "record 0: missing required column 'kind'"),
    "record not an object": ([[1, 2]], "record 0: expected an object with a 'kind', got list"),
    "missing token ids": (
        [{"kind": "node", "tree_id": 0, "node_id": 1, "parent_id": None}],
        "tree 0, node 1: missing required column 'token_ids'",
    ),
    "missing parent id": (
        [{"kind": "node", "tree_id": 0, "node_id": 1, "token_ids": [1]}],
        "tree 0, node 1: missing required column 'parent_id' (null for a root)",
    ),
    "missing node id": ([{"kind": "node", "tree_id": 0, "parent_id": None, "token_ids": [1]}], "record 0 (node): missing required column 'node_id'"),
    "missing tree id": ([{"kind": "node", "node_id": 0, "parent_id": None, "token_ids": [1]}], "record 0 (node): missing required column 'tree_id'"),
    "missing leaf": (BASE + [{"kind": "trajectory", "tree_id": 0}], "record 3 (trajectory): missing required column 'leaf'"),
    "non-integer node id": ([node(0, "a", None, [1])], "record 0 (node): column 'node_id' must be an integer, got 'a'"),
    "node column on trajectory row": (
        BASE + [trajectory(0, 1, token_ids=[1])],
        "record 3 (trajectory): column 'token_ids' does not apply to trajectory rows",
    ),
    "list on trajectory row": (
        BASE + [trajectory(0, 1, reward=[1.0])],
        "tree 0, trajectory at record 3: field 'reward' must be a scalar (per-token values belong on node rows)",
    ),
    "trajectory field missing on one row": (
        BASE + [trajectory(0, 1, reward=1.0), trajectory(0, 2)],
        "tree 0, trajectory at record 4: missing field 'reward' that other trajectories have",
    ),
    "trajectory field missing on an implied trajectory": (
        BASE + [trajectory(0, 1, reward=1.0), node(1, 0, None, [5])],
        "tree 1, trajectory at leaf node 0: missing field 'reward' that other trajectories have (its tree has no trajectory rows)",
    ),
    "per-token field missing on a node": (
        [node(0, 0, None, [1]), node(0, 1, 0, [2], logprobs=[-1.0]), trajectory(0, 1, trajectory_id=0)],
        "tree 0, node 0: missing field 'logprobs' that other nodes have",
    ),
    "logprobs under two names": (
        [node(0, 0, None, [1], logprobs=[-1.0], rollout_logprobs=[-1.0])],
        "columns 'logprobs' and 'rollout_logprobs' name the same batch field",
    ),
    "no nodes": ([trajectory(0, 1)], "no node rows"),
    "bad schema version": ([{"kind": "schema", "version": 99}] + BASE, "record 0 (schema): unsupported schema version 99"),
    "schema float into int": (
        [{"kind": "schema", "version": 1, "token_fields": {"weight": "<i8"}}, node(0, 0, None, [1], weight=[0.5])],
        "tree 0, node 0: field 'weight' holds float64 values that do not fit its dtype int64",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID_TABLES))
def test_invalid_tables_are_rejected_with_a_clear_message(case):
    records, message = INVALID_TABLES[case]
    with pytest.raises(RolloutInputError) as error:
        read_node_table_records(records)
    assert message in str(error.value)


def test_parquet_without_a_required_column(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"kind": ["node"], "tree_id": [0], "node_id": [0], "parent_id": pa.array([None], pa.int64())}), path)
    with pytest.raises(RolloutInputError, match="tree 0, node 0: missing required column 'token_ids'"):
        read_node_table(path)
    pq.write_table(pa.table({"tree_id": [0]}), path)
    with pytest.raises(RolloutInputError, match="missing required column 'kind'"):
        read_node_table(path)


def test_parquet_with_nulls_inside_token_lists(tmp_path):
    path = tmp_path / "t.parquet"
    table = pa.table(
        {"kind": ["node"], "tree_id": [0], "node_id": [0], "parent_id": pa.array([None], pa.int64()), "token_ids": [[1, None]]}
    )
    pq.write_table(table, path)
    with pytest.raises(RolloutInputError, match="column 'token_ids' holds null entries inside a list"):
        read_node_table(path)


def test_parquet_float_token_ids_are_rejected(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"kind": ["node"], "tree_id": [1], "node_id": [2], "parent_id": pa.array([None], pa.int64()), "token_ids": [[1.0, 2.5]]}),
        path,
    )
    with pytest.raises(RolloutInputError, match=r"tree 1, node 2: column 'token_ids' entry 0 is 1.0, not an integer token id"):
        read_node_table(path)


def test_file_errors(tmp_path):
    with pytest.raises(RolloutInputError, match=r"unsupported node-table format '\.csv'"):
        read_node_table(tmp_path / "x.csv")
    with pytest.raises(RolloutInputError, match="no such node-table file"):
        read_node_table(tmp_path / "absent.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(node(0, 0, None, [1])) + "\n{not json\n")
    with pytest.raises(RolloutInputError, match="line 2 is not valid JSON"):
        read_node_table(bad)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(RolloutInputError, match="not a readable Parquet file"):
        read_node_table(garbage)
    with pytest.raises(RolloutInputError, match="unsupported node-table format"):
        write_node_table(small_batch(), tmp_path / "x.txt")


def test_writer_rejects_fields_it_cannot_round_trip(tmp_path):
    tokens = [[1, 2], [3]]
    with pytest.raises(RolloutInputError, match="field 'logprobs': the name is reserved"):
        write_node_table(RolloutBatch.from_trajectories(tokens, logprobs=[[0.0, 0.0], [0.0]]), tmp_path / "a.jsonl")
    with pytest.raises(RolloutInputError, match="field 'leaf': the name is reserved"):
        write_node_table(RolloutBatch.from_trajectories(tokens, leaf=[1, 2]), tmp_path / "a.jsonl")
    with pytest.raises(RolloutInputError, match="trajectory 1: field 'tokens' is empty"):
        RolloutBatch(tokens=(np.array([1]), np.array([], dtype=np.int64)), token_fields={}, tree_ids=None)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"batch{suffix}"
    write_node_table(small_batch(), path)
    before = path.read_bytes()

    def fail_halfway(content, target: Path) -> None:
        target.write_bytes(b"half a table")
        raise OSError("disk full")

    writer = "_write_jsonl" if suffix == ".jsonl" else "_write_parquet"
    monkeypatch.setattr(node_table_writer, writer, fail_halfway)
    other = RolloutBatch.from_trajectories([[5, 6, 7]])
    with pytest.raises(OSError, match="disk full"):
        write_node_table(other, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with pytest.raises(OSError):
        write_node_table(other, tmp_path / f"new{suffix}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_written_file_has_ordinary_permissions(tmp_path):
    path = tmp_path / "b.jsonl"
    write_node_table(small_batch(), path)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


# ----------------------------------------------------------------------------- from_trajectories errors

FROM_TRAJECTORIES_ERRORS = {
    "empty trajectory": (dict(token_lists=[[1, 2], []]), "trajectory 1: field 'tokens' is empty"),
    "float token": (dict(token_lists=[[2.5, 1]]), "trajectory 0: field 'tokens' entry 0 is 2.5, not an integer token id"),
    "string token": (dict(token_lists=[[1], ["a", "b"]]), "trajectory 1: field 'tokens' entry 0 is 'a', not an integer token id"),
    "negative token": (dict(token_lists=[[3, -4]]), "trajectory 0: field 'tokens' entry 1 is -4, token ids must be >= 0"),
    "nested tokens": (dict(token_lists=[[[1, 2]]]), "trajectory 0: field 'tokens' must be a flat list of token ids"),
    "no trajectories": (dict(token_lists=[]), "field 'tokens': the batch holds no trajectories"),
    "metadata length": (
        dict(token_lists=[[1, 2], [3]], loss_mask=[[1, 1], [1, 1]]),
        "trajectory 1: field 'loss_mask' has 2 entries, expected 1 (one per token)",
    ),
    "metadata count": (dict(token_lists=[[1, 2], [3]], reward=[1.0]), "field 'reward': expected one entry per trajectory (2), got 1"),
    "mixed per-token and scalar": (
        dict(token_lists=[[1, 2], [3]], advantages=[[0.5, 0.5], 0.5]),
        "trajectory 1: field 'advantages' mixes per-token lists and scalars",
    ),
    "tree ids count": (dict(token_lists=[[1], [2]], tree_ids=[0]), "field 'tree_ids': expected one entry per trajectory (2)"),
}


@pytest.mark.parametrize("case", sorted(FROM_TRAJECTORIES_ERRORS))
def test_from_trajectories_errors(case):
    kwargs, message = FROM_TRAJECTORIES_ERRORS[case]
    token_lists = kwargs.pop("token_lists")
    with pytest.raises(RolloutInputError) as error:
        RolloutBatch.from_trajectories(token_lists, **kwargs)
    assert message in str(error.value)


# ----------------------------------------------------------------------------- property tests


def random_batch(seed: int, trees: int, trajectories_per_tree: int, vocab: int) -> RolloutBatch:
    """Random rollout trees grown by forking, forks biased to chunk boundaries (63, 64, 65, ...)."""
    rng = np.random.default_rng(seed)
    tokens, masks, logprobs, tree_ids = [], [], [], []
    tree_labels = rng.choice(np.arange(-5, 50), size=trees, replace=False)
    for tree in tree_labels:
        first = len(tokens)
        for k in range(trajectories_per_tree):
            if k == 0:
                length = int(rng.integers(1, 200))
                own_tokens = rng.integers(0, vocab, size=length)
                own_mask = rng.integers(0, 2, size=length).astype(np.float32)
                own_logprobs = -rng.integers(0, 64, size=length).astype(np.float32) / 8
            else:
                parent = int(rng.integers(first, len(tokens)))
                parent_length = len(tokens[parent])
                candidates = [p for p in (63, 64, 65, 127, 128, 129) if p <= parent_length]
                fork = int(rng.choice(candidates)) if candidates and rng.random() < 0.5 else int(rng.integers(0, parent_length + 1))
                extra = int(rng.integers(0 if fork else 1, 80))
                own_tokens = np.concatenate([tokens[parent][:fork], rng.integers(0, vocab, size=extra)])
                own_mask = np.concatenate([masks[parent][:fork], rng.integers(0, 2, size=extra).astype(np.float32)])
                own_logprobs = np.concatenate([logprobs[parent][:fork], -rng.integers(0, 64, size=extra).astype(np.float32) / 8])
                if fork and rng.random() < 0.2:
                    # Shared tokens, different metadata: the writer must split these positions.
                    own_mask[int(rng.integers(0, fork))] = 0.5
                if fork and rng.random() < 0.1:
                    own_logprobs[int(rng.integers(0, fork))] = np.nan if rng.random() < 0.5 else -0.0
            tokens.append(own_tokens)
            masks.append(own_mask)
            logprobs.append(own_logprobs.astype(np.float32))
            tree_ids.append(int(tree))
    order = rng.permutation(len(tokens))
    count = len(tokens)
    return RolloutBatch(
        tokens=tuple(np.asarray(tokens[i], dtype=np.int64) for i in order),
        token_fields={
            "loss_mask": tuple(masks[i] for i in order),
            # per-token values that may hold NaN (log-probs may not): the writer must keep NaN and -0.0 apart
            "values": tuple(logprobs[i] for i in order),
        },
        trajectory_fields={
            "group_id": np.asarray(tree_ids, dtype=np.int64)[order],
            "reward": rng.integers(0, 2, size=count).astype(np.float64),
            "advantage": rng.normal(size=count).astype(np.float32),
            "truncated": rng.random(count) < 0.3,
        },
        tree_ids=np.asarray(tree_ids, dtype=np.int64)[order],
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    trees=st.integers(1, 4),
    per_tree=st.integers(1, 9),
    vocab=st.sampled_from([2, 5, 1000]),
)
def test_write_then_read_is_identical(tmp_path_factory, seed, trees, per_tree, vocab):
    batch = random_batch(seed, trees, per_tree, vocab)
    directory = tmp_path_factory.mktemp("roundtrip")
    for suffix in SUFFIXES:
        path = directory / f"batch{suffix}"
        write_node_table(batch, path)
        assert_identical(read_node_table(path), batch)
    assert_identical(read_node_table_records(node_table_records(batch)), batch)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), trees=st.integers(1, 4), per_tree=st.integers(1, 9))
def test_written_tables_are_radix_trees(seed, trees, per_tree):
    """Every written node is non-empty and no two siblings start with the same (token, values)."""
    batch = random_batch(seed, trees, per_tree, vocab=3)
    records = node_table_records(batch)
    nodes = [r for r in records if r["kind"] == "node"]
    first_keys: dict[tuple, set] = {}
    child_count: dict[tuple, int] = {}
    ending: set[tuple] = {(r["tree_id"], r["leaf"]) for r in records if r["kind"] == "trajectory"}
    for r in nodes:
        assert r["token_ids"], r
        key = (r["token_ids"][0], r["loss_mask"][0], json.dumps(r["values"][0]))
        siblings = first_keys.setdefault((r["tree_id"], r["parent_id"]), set())
        assert key not in siblings
        siblings.add(key)
        child_count[(r["tree_id"], r["parent_id"])] = child_count.get((r["tree_id"], r["parent_id"]), 0) + 1
    # A node with one child must end a trajectory, else the two would have been one node.
    for r in nodes:
        if child_count.get((r["tree_id"], r["node_id"]), 0) == 1:
            assert (r["tree_id"], r["node_id"]) in ending
    # Node tokens never exceed the batch's raw tokens and cover each tree's distinct prefixes.
    assert sum(len(r["token_ids"]) for r in nodes) <= batch.semantic_tokens


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_node_tables_survive_write_and_read(data):
    """Random node tables (interior leaves, empty nodes) read, write and read back the same."""
    records = []
    for tree in range(data.draw(st.integers(1, 3), label="trees")):
        count = data.draw(st.integers(1, 12), label="nodes")
        for node_id in range(count):
            parent = None if node_id == 0 else data.draw(st.integers(0, node_id - 1))
            tokens = data.draw(st.lists(st.integers(0, 3), min_size=0 if node_id else 1, max_size=70))
            mask = data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=len(tokens), max_size=len(tokens)))
            records.append(node(tree, node_id, parent, tokens, loss_mask=mask))
        if data.draw(st.booleans(), label="explicit trajectories"):
            for leaf in data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=6)):
                records.append(trajectory(tree, leaf, reward=data.draw(st.floats(-2, 2))))
    try:
        batch = read_node_table_records(records)
    except RolloutInputError as error:
        assert "empty trajectory" in str(error) or "missing field 'reward'" in str(error)
        return
    assert_identical(read_node_table_records(node_table_records(batch)), batch)
