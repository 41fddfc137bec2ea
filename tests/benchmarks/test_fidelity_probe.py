"""The fidelity probe (benchmarks/fidelity_probe.py) on CPU: in float64 HARTS matches the baseline layer by layer."""

from __future__ import annotations

import json

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("fidelity_probe.py")


@pytest.mark.parametrize("blocks_only", [False, True])
def test_probe_traces_every_layer_and_harts_matches_in_float64(probe, tmp_path, blocks_only):
    out = tmp_path / "probe.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--dtype", "float64", "--tokens", "3000", "--scale", "0.02",
            "--trajectories", "5", "--out", str(out)]
    results = probe.main(argv + (["--blocks-only"] if blocks_only else []))
    assert json.loads(out.read_text())["trace"]["trajectories"] == results["trace"]["trajectories"]
    layers = results["trace"]["layers"]
    assert [row["layer"] for row in layers] == list(range(4))
    for row in layers:
        assert row["harts_cosine"] > 1 - 1e-12
        assert row["harts_max_abs_diff"] < 1e-9
        assert row["harts_mixer_max_abs_diff"] < 1e-9 and row["harts_ffn_max_abs_diff"] < 1e-9
    # a recorded first difference names a real place
    for where in results["trace"]["first_difference"].values():
        assert 0 <= where["layer"] < 4 and where["part"] in ("mixer", "ffn", "block")
        assert 0 <= where["position"] < where["length"]
    assert all(value >= 0 for value in results["ops"].values())
