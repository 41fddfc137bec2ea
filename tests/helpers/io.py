"""Node-table test helpers: small batches, node and trajectory records, exact batch equality."""

from __future__ import annotations

import numpy as np

from harts import RolloutBatch


def assert_identical(actual: RolloutBatch, expected: RolloutBatch) -> None:
    """Same tokens, fields (values, bits and dtypes), tree ids and trajectory order."""
    assert len(actual) == len(expected)
    for got, want in zip(actual.tokens, expected.tokens):
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    assert set(actual.token_fields) == set(expected.token_fields)
    for name, values in expected.token_fields.items():
        for got, want in zip(actual.token_fields[name], values):
            assert got.dtype == want.dtype, name
            assert got.tobytes() == want.tobytes(), name
    assert set(actual.trajectory_fields) == set(expected.trajectory_fields)
    for name, want in expected.trajectory_fields.items():
        got = actual.trajectory_fields[name]
        assert got.dtype == want.dtype, name
        assert got.tobytes() == want.tobytes(), name
    np.testing.assert_array_equal(actual.tree_ids, expected.tree_ids)
    assert actual.content_hash() == expected.content_hash()


def node(tree, node_id, parent, tokens, **fields):
    return {"kind": "node", "tree_id": tree, "node_id": node_id, "parent_id": parent, "token_ids": tokens, **fields}


def trajectory(tree, leaf, **fields):
    return {"kind": "trajectory", "tree_id": tree, "leaf": leaf, **fields}


def small_batch() -> RolloutBatch:
    return RolloutBatch.from_trajectories(
        [[1, 2, 3, 4], [9, 8], [1, 2, 3, 5, 6], [1, 2], [9, 8, 7]],
        tree_ids=[0, 1, 0, 0, 1],
        loss_mask=[
            np.float32([0, 0, 1, 1]),
            np.float32([0, 1]),
            np.float32([0, 0, 1, 1, 1]),
            np.float32([0, 1]),  # differs from its siblings at position 1
            np.float32([0, 1, 1]),
        ],
        # a per-token field that may hold NaN (log-probs may not): the writer must keep NaN and -0.0 apart
        values=[
            np.float32([0, -0.5, -1.25, np.nan]),
            np.float32([0, -0.0]),
            np.float32([0, -0.5, -1.25, -3, -4]),
            np.float32([0, -0.5]),
            np.float32([0, -0.0, -2]),
        ],
        group_id=np.array([0, 1, 0, 0, 1]),
        reward=np.array([1.0, 0.0, 0.0, 1.0, 1.0]),
        advantage=np.float32([0.5, -1, -1, 0.5, 1]),
        tag=np.array(["a", "b", "c", "d", "e"]),
    )


def corrupt(data: bytes, how: str, position: int, value: int) -> bytes:
    position %= max(1, len(data))
    if how == "flip":
        return data[:position] + bytes([data[position] ^ (value or 1)]) + data[position + 1:]
    if how == "truncate":
        return data[:position]
    if how == "insert":
        return data[:position] + bytes([value]) + data[position:]
    return data[:position] + data[position + 1:]
