"""Bad or mutable input is never silently accepted: the batch owns read-only copies, every per-token field is read
the same from lists, NumPy arrays and torch tensors (or refused), masks are finite and in [0, 1], and node tables
refuse partial fields, lossy casts and damaged bytes with a message naming the file, tree, node or field."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts
from harts import RolloutBatch
from harts.errors import OutputError, PipelineError, RolloutInputError
from harts.rollouts import read_node_table, read_node_table_records, write_node_table
from tests.helpers import assert_identical, node, small_batch, trajectory
from tests.helpers import corrupt

TOKENS = [[5, 6, 7, 8, 9], [5, 6, 7], [5, 6, 7, 8, 1, 2]]
MASKS = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 0, 1, 0, 1, 1]]


# ----------------------------------------------------------------------------- ownership


def test_the_batch_owns_read_only_copies_of_its_inputs():
    tokens = [np.array(t) for t in TOKENS]
    masks = [np.array(m, dtype=np.float32) for m in MASKS]
    rewards = np.array([1.0, 0.0, 1.0])
    batch = RolloutBatch.from_trajectories(tokens, loss_mask=masks, reward=rewards)
    digest = batch.content_hash()
    tokens[0][1] = 99
    masks[1][:] = 0.5
    rewards[0] = 7.0
    assert batch.tokens[0].tolist() == TOKENS[0]
    assert batch.loss_mask[1].tolist() == MASKS[1]
    assert batch.trajectory_fields["reward"].tolist() == [1.0, 0.0, 1.0]
    fresh = RolloutBatch.from_trajectories(TOKENS, loss_mask=[np.float32(m) for m in MASKS], reward=[1.0, 0.0, 1.0])
    assert batch.content_hash() == digest == fresh.content_hash()
    for array in (batch.tokens[0], batch.loss_mask[0], batch.trajectory_fields["reward"], batch.tree_ids):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1


def test_the_constructor_copies_too():
    tokens = np.array([3, 4, 5])
    batch = RolloutBatch(tokens=(tokens,), token_fields={}, tree_ids=None)
    tokens[0] = 8
    assert batch.tokens[0].tolist() == [3, 4, 5]
    assert batch.loss_mask[0].tolist() == [1, 1, 1]  # the default mask is added on every construction


def test_changing_the_callers_arrays_after_compile_leaves_the_plans_results_alone():
    """The reported bug: log-probs 0.95 away from the baseline after the caller reused its token buffers."""
    from harts.runtime import log_probs, log_probs_baseline
    from tests.helpers import tiny_model

    tokens = [np.array(t) for t in TOKENS]
    batch = RolloutBatch.from_trajectories(tokens, loss_mask=[np.array(m) for m in MASKS])
    plan = harts.compile(batch, capacity=64, chunk_size=4)
    for array in tokens:
        array[:] = np.arange(len(array)) % 7 + 20  # the caller refills its buffers with the next batch
    model = tiny_model()
    reference = log_probs_baseline(model, RolloutBatch.from_trajectories(TOKENS, loss_mask=MASKS))
    out = log_probs(model, plan, batch)
    for got, want in zip(out.log_probs, reference.log_probs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- containers


def as_numpy(values):
    return [np.asarray(v) for v in values]


def as_torch(values):
    return [torch.as_tensor(np.asarray(v, dtype=np.float32)) for v in values]


@pytest.mark.parametrize("container", [list, as_numpy, as_torch])
def test_per_token_fields_read_the_same_from_lists_numpy_and_torch(container):
    weights = [[0.5, 0.25, 1.0, 0.0, 0.75], [1.0, 0.5, 0.25], [0.0, 0.5, 1.0, 0.25, 0.5, 0.75]]
    batch = RolloutBatch.from_trajectories(container(TOKENS) if container is not as_torch else [torch.tensor(t) for t in TOKENS],
                                           loss_mask=container(MASKS), old_log_probs=container(weights))
    assert [m.tolist() for m in batch.loss_mask] == MASKS
    assert [w.tolist() for w in batch.token_fields["old_log_probs"]] == weights
    assert [t.tolist() for t in batch.tokens] == TOKENS


@pytest.mark.parametrize("advantages", [[0.5, -1.0, 2.0], np.array([0.5, -1.0, 2.0]), torch.tensor([0.5, -1.0, 2.0]),
                                        [torch.tensor(0.5), np.float64(-1.0), 2.0]])
def test_per_trajectory_scalars_read_the_same_from_every_container(advantages):
    batch = RolloutBatch.from_trajectories(TOKENS, advantages=advantages)
    assert batch.trajectory_fields["advantages"].tolist() == [0.5, -1.0, 2.0]
    assert "advantages" not in batch.token_fields


@pytest.mark.parametrize("masks", [[1.0, 0.0, 1.0], np.array([1.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 1.0])])
def test_one_loss_mask_scalar_per_trajectory_is_refused_not_replaced_by_ones(masks):
    with pytest.raises(RolloutInputError, match="field 'loss_mask' is per-token"):
        RolloutBatch.from_trajectories(TOKENS, loss_mask=masks)


def test_2d_tensors_are_rows_per_trajectory_and_must_match_the_lengths():
    batch = RolloutBatch.from_trajectories(torch.tensor([[1, 2, 3], [1, 2, 4]]), loss_mask=torch.tensor([[0, 1, 1], [0, 0, 1]]))
    assert [m.tolist() for m in batch.loss_mask] == [[0, 1, 1], [0, 0, 1]]
    with pytest.raises(RolloutInputError, match="trajectory 0: field 'loss_mask' has 6 entries, expected 5"):
        RolloutBatch.from_trajectories(TOKENS, loss_mask=torch.ones(3, 6))  # padded to the longest: not per-token


def test_bfloat16_tensors_widen_exactly():
    values = torch.tensor([0.5, 0.25, 1.0], dtype=torch.bfloat16)
    batch = RolloutBatch.from_trajectories([[1, 2, 3]], loss_mask=[values])
    assert batch.loss_mask[0].dtype == np.float32 and batch.loss_mask[0].tolist() == [0.5, 0.25, 1.0]


INVALID_BATCHES = {
    "nan mask": (dict(loss_mask=[[np.nan, 1, 1, 1, 1], [1, 1, 1], [1] * 6]), "trajectory 0: field 'loss_mask' entry 0 is nan; its values must be finite"),
    "infinite mask": (dict(loss_mask=[[1] * 5, [1, np.inf, 1], [1] * 6]), "trajectory 1: field 'loss_mask' entry 1 is inf"),
    "negative mask": (dict(loss_mask=[[1] * 5, [1, 1, 1], [1, 1, -0.5, 1, 1, 1]]), "trajectory 2: field 'loss_mask' entry 2 is -0.5; mask values must lie in [0, 1]"),
    "mask above one": (dict(loss_mask=[[1, 1, 1, 1, 2], [1, 1, 1], [1] * 6]), "trajectory 0: field 'loss_mask' entry 4 is 2; mask values must lie in [0, 1]"),
    "nan advantage": (dict(advantages=[0.0, np.nan, 1.0]), "trajectory 1: field 'advantages' is nan; its values must be finite"),
    "nan per-token advantage": (dict(advantages=[[0.0] * 5, [0.0, 0.0, np.nan], [0.0] * 6]), "trajectory 1: field 'advantages' entry 2 is nan"),
    "infinite reward": (dict(reward=[0.0, 1.0, -np.inf]), "trajectory 2: field 'reward' is -inf"),
    "string advantages": (dict(advantages=["good", "bad", "good"]), "field 'advantages': values must be numbers"),
    "strings and numbers": (dict(tag=["a", 1, "b"]), "field 'tag': per-trajectory values mix integers and strings"),
    "string per-token values": (dict(note=[["a"] * 5, ["b"] * 3, ["c"] * 6]), "trajectory 0: field 'note' holds non-numeric values"),
    "ragged per-token entry": (dict(weight=[[1, [2, 3], 4, 5, 6], [1, 2, 3], [1] * 6]), "trajectory 0: field 'weight' is ragged"),
    "nested per-token entry": (dict(weight=[[[1, 2]] * 5, [1, 2, 3], [1] * 6]), "trajectory 0: field 'weight' has shape (5, 2)"),
    "object field": (dict(weight=[{"a": 1}, {"b": 2}, {"c": 3}]), "must be a list, a NumPy array or a torch tensor, got dict"),
    "float tree ids": (dict(tree_ids=[0.5, 1.5, 2.5]), "field 'tree_ids' entry 0 is 0.5, not an integer tree id"),
    "huge tree ids": (dict(tree_ids=[0, 2**70, 1]), "field 'tree_ids' entry 1 is 1180591620717411303424, above the largest allowed"),
    "boolean tree ids": (dict(tree_ids=[True, False, True]), "field 'tree_ids' entry 0 is True, not an integer tree id"),
}


@pytest.mark.parametrize("case", sorted(INVALID_BATCHES))
def test_invalid_fields_are_refused_naming_trajectory_field_and_entry(case):
    fields, message = INVALID_BATCHES[case]
    with pytest.raises(RolloutInputError) as error:
        RolloutBatch.from_trajectories(TOKENS, **fields)
    assert message in str(error.value)


@pytest.mark.parametrize("masks", [[[True, False, True, True, True], [False, True, True], [True] * 6], MASKS,
                                   [np.float16([0, 0.5, 1, 1, 1]), np.float16([0, 1, 1]), np.float16([1] * 6)]])
def test_masks_of_booleans_zero_one_integers_or_fractions_are_accepted(masks):
    batch = RolloutBatch.from_trajectories(TOKENS, loss_mask=masks)
    assert all(((m >= 0) & (m <= 1)).all() for m in batch.loss_mask)


INVALID_TOKENS = {
    "ragged token list": ([[1, [2, 3]], [1]], "trajectory 0: field 'tokens' is ragged"),
    "flat list": ([1, 2, 3], "expected a list of token lists, one per trajectory, got a flat list of token ids"),
    "huge id": ([[1, 10**30]], "trajectory 0: field 'tokens' entry 1 is 1000000000000000000000000000000, above the largest id"),
    "float tensor": ([torch.tensor([1.0, 2.0])], "trajectory 0: field 'tokens' entry 0 is 1.0, not an integer token id"),
    "dict": ({"a": [1]}, "field 'tokens': expected a list with one entry per trajectory, got dict"),
    "scalar tensor": (torch.tensor(5), "field 'tokens': expected one entry per trajectory, got a single value 5"),
}


@pytest.mark.parametrize("case", sorted(INVALID_TOKENS))
def test_invalid_token_lists_are_refused(case):
    tokens, message = INVALID_TOKENS[case]
    with pytest.raises(RolloutInputError) as error:
        RolloutBatch.from_trajectories(tokens)
    assert message in str(error.value)


# ----------------------------------------------------------------------------- node tables

PARTIAL_FIELDS = {
    "loss mask on one node of three": (
        [node(0, 0, None, [1, 2]), node(0, 1, 0, [3], loss_mask=[0]), node(0, 2, 0, [4, 5])],
        "tree 0, node 0; tree 0, node 2: missing field 'loss_mask' that other nodes have",
    ),
    "a field missing in another tree": (
        [node(0, 0, None, [1], weight=[1.0]), node(1, 0, None, [2])],
        "tree 1, node 0: missing field 'weight' that other nodes have",
    ),
    "many nodes named, the rest counted": (
        [node(0, 0, None, [1], loss_mask=[1])] + [node(0, i, 0, [i + 1]) for i in range(1, 9)],
        "tree 0, node 1; tree 0, node 2; tree 0, node 3; tree 0, node 4; tree 0, node 5 (and 3 more)",
    ),
}


def test_nodes_without_tokens_may_omit_per_token_fields():
    batch = read_node_table_records([node(0, 0, None, []), node(0, 1, 0, [3, 4], loss_mask=[0, 1])])
    assert batch.loss_mask[0].tolist() == [0, 1]


def schema(token_fields=None, trajectory_fields=None):
    return {"kind": "schema", "version": 1, "token_fields": token_fields or {}, "trajectory_fields": trajectory_fields or {}}


LOSSY_CASTS = {
    "int8 wrap": ([schema({"w": "<i1"}), node(0, 0, None, [1, 2], w=[5, 1000])], "tree 0, node 0: field 'w' entry 1 is 1000, outside the range -128..127 of its dtype int8"),
    "uint8 negative": ([schema({"w": "<u1"}), node(0, 0, None, [1], w=[-1])], "field 'w' entry 0 is -1, outside the range 0..255 of its dtype uint8"),
    "float16 overflow": ([schema({"w": "<f2"}), node(0, 0, None, [1], w=[1e10])], "field 'w' entry 0 is 10000000000.0, outside the range of its dtype float16"),
    "inexact integer in float16": ([schema({"w": "<f2"}), node(0, 0, None, [1], w=[2049])], "field 'w' entry 0 is 2049, an integer that cannot be held exactly by its dtype float16"),
    "float into an integer dtype": ([schema({"w": "<i8"}), node(0, 0, None, [1], w=[0.5])], "field 'w' holds float64 values that do not fit its dtype int64"),
    "integer two as a boolean": ([schema({"w": "|b1"}), node(0, 0, None, [1], w=[2])], "field 'w' entry 0 is 2, which is not a boolean (0 or 1)"),
    "string longer than its dtype": ([schema(trajectory_fields={"tag": "<U1"}), node(0, 0, None, [1]), trajectory(0, 0, tag="long")],
                                     "trajectory rows: field 'tag' entry 0 is 'long', a string longer than its dtype <U1"),
    "trajectory int16 wrap": ([schema(trajectory_fields={"k": "<i2"}), node(0, 0, None, [1]), trajectory(0, 0, k=70000)],
                              "trajectory rows: field 'k' entry 0 is 70000, outside the range"),
    "object dtype in a schema": ([schema({"w": "|O"}), node(0, 0, None, [1], w=[1])], "field 'w' has an unknown or unsupported dtype '|O'"),
    "structured dtype in a schema": ([schema({"w": [["a", "<i4"]]}), node(0, 0, None, [1], w=[1])], "unknown or unsupported dtype"),
    "unknown schema entry": ([{**schema(), "colour": "red"}, node(0, 0, None, [1])], "unknown schema entries 'colour'"),
    "mask outside [0, 1]": ([node(0, 0, None, [1, 2], loss_mask=[0, 3])], "tree 0, node 0: field 'loss_mask' entry 1 is 3.0; mask values must lie in [0, 1]"),
    "nan mask": ([node(0, 0, None, [1], loss_mask=[float("nan")])], "tree 0, node 0: field 'loss_mask' entry 0 is nan; its values must be finite"),
    "huge integers": ([node(0, 0, None, [1], w=[2**70])], "tree 0, node 0: field 'w' entry 0 is 1180591620717411303424, too large for 64 bits"),
    "booleans beside numbers": ([node(0, 0, None, [1, 2], w=[True, 2])], "field 'w' holds values of several types (bool, int)"),
    "strings beside numbers in trajectory rows": ([node(0, 0, None, [1]), node(0, 1, 0, [2]), trajectory(0, 0, tag="a"), trajectory(0, 1, tag=3)],
                                                  "field 'tag' holds values of several types (int, str)"),
    "huge node id": ([node(0, 10**30, None, [1])], "record 0 (node): column 'node_id' is 1000000000000000000000000000000, outside the 64-bit integer range"),
    "huge tree id": ([node(-(2**64), 0, None, [1])], "column 'tree_id' is -18446744073709551616, outside the 64-bit integer range"),
    "ragged token ids": ([node(0, 0, None, [[1], [2, 3]])], "tree 0, node 0: column 'token_ids' is ragged"),
}


@pytest.mark.parametrize("case", sorted({**PARTIAL_FIELDS, **LOSSY_CASTS}))
def test_partial_fields_and_casts_that_would_change_a_value_are_refused_naming_the_culprit(case):
    records, message = {**PARTIAL_FIELDS, **LOSSY_CASTS}[case]
    with pytest.raises(RolloutInputError) as error:
        read_node_table_records(records)
    assert message in str(error.value)


DTYPES = ["|b1", "<i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", ">f4", ">i2"]


def extreme_values(dtype: np.dtype, count: int) -> np.ndarray:
    if dtype.kind == "b":
        return np.arange(count) % 2 == 0
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.resize(np.array([info.min, info.max, 0, 1], dtype=dtype), count)
    info = np.finfo(dtype)
    return np.resize(np.array([info.max, -info.max, info.tiny, -0.0, np.nan, np.inf], dtype=dtype), count)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_type_harts_writes_it_reads_back(tmp_path, suffix, dtype):
    dtype = np.dtype(dtype)
    per_token = [extreme_values(dtype, len(t)) for t in TOKENS]
    batch = RolloutBatch.from_trajectories(TOKENS, weight=per_token, scalar=extreme_values(dtype, len(TOKENS)))
    path = tmp_path / f"table{suffix}"
    write_node_table(batch, path)
    assert_identical(read_node_table(path), batch)
    assert read_node_table(path).token_fields["weight"][0].dtype == dtype.newbyteorder("=")


def write_records(path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_reader_errors_name_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(node(0, 0, None, [1])).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(RolloutInputError, match=r"bad.jsonl: line 2 is not UTF-8 text"):
        read_node_table(path)
    path.write_text("[" * 100_000 + "\n")
    with pytest.raises(RolloutInputError, match=r"bad.jsonl: line 1 (nests lists or objects too deeply|is not valid JSON)"):
        read_node_table(path)
    directory = tmp_path / "dir.jsonl"
    directory.mkdir()
    with pytest.raises(RolloutInputError, match=r"dir.jsonl: is a directory, not a node-table file"):
        read_node_table(directory)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1" + bytes(range(256)) * 4 + b"PAR1")
    with pytest.raises(RolloutInputError, match=r"garbage.parquet: not a readable Parquet file"):
        read_node_table(garbage)
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"kind": ["node"], "tree_id": [0], "node_id": [0], "parent_id": pa.array([None], pa.int64()),
                             "token_ids": [[1]], "extra": [{"a": 1}]}), nested)
    with pytest.raises(RolloutInputError, match=r"nested.parquet: column 'extra' has unsupported type struct"):
        read_node_table(nested)


def test_a_written_table_edited_afterwards_is_refused_until_its_hash_is_dropped(tmp_path):
    path = tmp_path / "b.jsonl"
    write_node_table(small_batch(), path)
    lines = path.read_text().splitlines()
    edited = [line.replace('"token_ids":[1]', '"token_ids":[7]', 1) for line in lines]
    assert edited != lines
    path.write_text("\n".join(edited) + "\n")
    with pytest.raises(RolloutInputError, match=r"b.jsonl: node table: the contents differ from what HARTS wrote"):
        read_node_table(path)
    header = json.loads(edited[0])
    del header["content_hash"]
    path.write_text("\n".join([json.dumps(header)] + edited[1:]) + "\n")
    assert read_node_table(path).tokens[0][0] == 7


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(suffix=st.sampled_from([".jsonl", ".parquet"]), how=st.sampled_from(["flip", "truncate", "insert", "delete"]),
       position=st.integers(0, 1 << 20), value=st.integers(0, 255), fraction=st.booleans())
def test_corrupted_node_tables_give_a_clean_error_or_identical_data(tmp_path, suffix, how, position, value, fraction):
    batch = small_batch()
    path = tmp_path / f"table{suffix}"
    path.unlink(missing_ok=True)  # an earlier example's corrupted table is not ours to overwrite any more
    write_node_table(batch, path)
    data = path.read_bytes()
    if fraction:  # also aim at the Parquet footer, where the schema and the hash live
        position = len(data) - 1 - position % 200
    path.write_bytes(corrupt(data, how, position, value))
    try:
        read = read_node_table(path)
    except RolloutInputError as error:
        assert str(path) in str(error)
        return
    assert_identical(read, batch)


# ----------------------------------------------------------------------------- compile options and outputs

DEGENERATE_OPTIONS = {
    "empty pipeline text": (dict(pipeline=""), "the pipeline is empty"),
    "empty pipeline list": (dict(pipeline=[]), "the pipeline is empty"),
    "huge chunk": (dict(chunk_size=10**6), "option 'chunk_size' is 1,000,000, above 4,096"),
    "capacity beyond int32 offsets": (dict(capacity=2**40), "option 'capacity' is 1,099,511,627,776, above 2,147,483,647"),
    "capacity as a pass option": (dict(pipeline="prefix-compress,partition-microbatches{capacity=4096}"),
                                  "pass 'partition-microbatches' has no option 'capacity'"),
    "zero dp": (dict(dp_size=0), "option 'dp_size' must be a positive integer, got 0"),
    "boolean capacity": (dict(capacity=True), "option 'capacity' must be a positive integer, got True"),
    "float chunk": (dict(chunk_size=64.0), "option 'chunk_size' must be a positive integer, got 64.0"),
}


@pytest.mark.parametrize("case", sorted(DEGENERATE_OPTIONS))
def test_degenerate_compile_options_are_refused_before_any_work(case):
    options, message = DEGENERATE_OPTIONS[case]
    with pytest.raises(PipelineError) as error:
        harts.compile(RolloutBatch.from_trajectories(TOKENS), **options)
    assert message in str(error.value)


def test_unwritable_outputs_raise_harts_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    with pytest.raises(OutputError, match=r"cannot write the node table to .*file/table.jsonl"):
        write_node_table(small_batch(), blocker / "table.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(OutputError, match="it is a directory"):
        write_node_table(small_batch(), tmp_path / "dir.jsonl")
    from harts.passes.manager import DumpIR

    with pytest.raises(OutputError, match=r"cannot dump the IR to .*file"):
        harts.compile(RolloutBatch.from_trajectories(TOKENS), capacity=64, chunk_size=4, instruments=[DumpIR(blocker)])
    assert blocker.read_text() == "mine"


GENERATOR_OPTIONS = {
    "swe-like:scale=100": "swe-like: these options generate about",
    "swe-like:tasks=0": "swe-like: option 'tasks' must be in 1..1,000,000, got 0",
    "grpo:groups=100000": "grpo: groups x group_size (the trajectories) must be in 1..1,000,000",
    "grpo:vocab_size=0": "grpo: option 'vocab_size' must be at least 2",
    "no-sharing:trajectories=0": "no-sharing: option 'trajectories' must be in 1..1,000,000, got 0",
    "wide-tree:prompt_tokens=70000": "wide-tree: need prompt and response lengths >= 1 with prompt + max_tokens <= 65535",
    "wide-tree:colour=red": "preset 'wide-tree': unknown option 'colour=red'",
}


@pytest.mark.parametrize("spec", sorted(GENERATOR_OPTIONS))
def test_generated_presets_refuse_options_that_cannot_or_should_not_be_built(spec):
    from harts.rollouts.inputs import resolve_input

    with pytest.raises(RolloutInputError) as error:
        resolve_input(spec)
    assert GENERATOR_OPTIONS[spec] in str(error.value)


def test_batch_hashes_are_sha256_over_the_bytes_of_each_array():
    """The hashes read arrays in place; they stay the digest of the arrays' bytes (``tobytes``), so plans
    compiled before keep binding."""
    import hashlib

    tokens = [[5, 1, 2], [5, 1, 9, 9]]
    routed = [np.arange(6).reshape(3, 1, 2), np.arange(8).reshape(4, 1, 2)]
    batch = RolloutBatch.from_trajectories(tokens, routed_experts=routed, reward=[0.5, 1.0])
    for input_only, value in ((True, batch.input_hash()), (False, batch.content_hash())):
        digest = hashlib.sha256(b"harts-batch-input-v1" if input_only else b"harts-batch-v1")
        for t in batch.tokens:
            digest.update(len(t).to_bytes(8, "little"))
            digest.update(np.asarray(t).astype("<i8").tobytes())
        digest.update(np.asarray(batch.tree_ids, dtype="<i8").tobytes())
        for name in sorted(batch.token_fields):
            if input_only and not name.startswith("routed_experts."):
                continue
            digest.update(f"token:{name}".encode())
            for values in batch.token_fields[name]:
                digest.update(str(values.dtype).encode())
                digest.update(np.ascontiguousarray(values).tobytes())
        for name in sorted(() if input_only else batch.trajectory_fields):
            values = batch.trajectory_fields[name]
            digest.update(f"trajectory:{name}:{values.dtype}".encode())
            digest.update(np.ascontiguousarray(values).tobytes())
        assert value == "sha256:" + digest.hexdigest()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 40), max_size=30), run_bytes=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_tokens_hashed_in_joined_runs_give_the_digest_of_one_update_per_piece(lengths, run_bytes, seed, monkeypatch):
    """The input hash hands the digest runs of joined trajectories (few GIL handoffs for the worker that hashes
    beside the trie build): for any run size, with trajectories shorter, as long as and longer than a run, and
    arrays that are views or of another dtype, the digest is that of a length and the ``<i8`` bytes per trajectory.
    (The run size is only read, so patching it for the whole test is what each example needs.)"""
    import hashlib

    from harts.rollouts import batch as batch_module

    rng = np.random.default_rng(seed)
    tokens = []
    for position, length in enumerate(lengths):
        values = rng.integers(0, 2**31, size=2 * length)
        tokens.append(values[::2] if position % 3 == 0 else values[:length].astype(np.int32) if position % 3 == 1 else values[:length])
    monkeypatch.setattr(batch_module, "_HASH_RUN_BYTES", run_bytes)
    joined = hashlib.sha256()
    batch_module._update_with_tokens(joined, tokens)
    expected = hashlib.sha256()
    for trajectory in tokens:
        expected.update(len(trajectory).to_bytes(8, "little"))
        expected.update(np.asarray(trajectory).astype("<i8").tobytes())
    assert joined.hexdigest() == expected.hexdigest()
