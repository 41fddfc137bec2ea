"""harts.models.save_pretrained: a HybridModel written as a transformers checkpoint and loaded back.

Tiny Qwen3-Next and Kimi Linear models (the configs of ``tests/helpers/hf.py``), changed on
the HARTS side as a training step would, are saved and loaded with
``AutoModelForCausalLM.from_pretrained``: the weights must come back exactly and the loaded
model must give the same per-token log-probs (transformers' own forward, float64 with its
float32 downcasts lifted as in ``tests/helpers/hf.py``; HARTS on a plan, bit for bit).
"""

from __future__ import annotations

import json

import pytest
import torch

import harts
from harts.models import HFModelError, from_hf, save_pretrained, to_hf_state_dict
from tests.helpers.hf import _finish, _perturb, harts_log_probs, kimi_linear_config, max_log_prob_diff, qwen3_next_config, reference_log_probs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")

TRAJECTORIES = [[3, 9, 4, 17, 21, 5, 5, 30, 2, 8, 11], [3, 9, 4, 17, 40, 41, 7], [12, 1, 1, 2]]
#: Kimi Linear's transformers modules create these in float32 whatever the model dtype.
KIMI_FLOAT32 = ("mlp.gate.weight", "e_score_correction_bias", "dt_bias")


def trained_model(architecture: str, dtype: torch.dtype, **overrides):
    hf_config = (qwen3_next_config if architecture == "qwen3_next" else kimi_linear_config)(**overrides)
    hf_config.dtype = dtype
    torch.manual_seed(2)
    model = from_hf(hf_config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))  # a HARTS-side update
    return model


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize(("architecture", "overrides"), [
    ("qwen3_next", {}),
    ("qwen3_next", dict(tie_word_embeddings=True)),
    ("kimi_linear", {}),
    ("kimi_linear", dict(n_shared_experts=0, q_lora_rank=None)),
])
def test_round_trip_through_from_pretrained_gives_equal_log_probs(tmp_path, architecture, overrides):
    model = trained_model(architecture, torch.float64, **overrides)
    path = save_pretrained(model, tmp_path / "checkpoint")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load(path)
    assert type(loaded).__name__ == harts.models.ARCHITECTURES[architecture]
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == model.config.tie_word_embeddings
    saved = to_hf_state_dict(model)
    state = loaded.state_dict()
    assert set(state) == set(saved)
    for key, tensor in saved.items():
        if architecture == "kimi_linear" and key.endswith(KIMI_FLOAT32):
            assert state[key].dtype == torch.float32 and torch.equal(state[key], tensor.to(torch.float32)), key
        else:
            assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key
    exact = architecture == "qwen3_next"
    # transformers' forward on the loaded checkpoint, trajectory by trajectory
    reference = _finish(loaded, torch.float64, seed=0, slow_decay=False, perturb=False)
    want = reference_log_probs(reference, TRAJECTORIES)
    reloaded = from_hf(reference)
    assert reloaded.config == model.config
    got, _ = harts_log_probs(reloaded, TRAJECTORIES, chunk_size=4, capacity=12)
    assert max_log_prob_diff(got.log_probs, want) <= 1e-8
    ours, _ = harts_log_probs(model, TRAJECTORIES, chunk_size=4, capacity=12)
    # Kimi's float32-held router and decay biases come back rounded: equal up to that rounding
    assert max_log_prob_diff(ours.log_probs, got.log_probs) <= (0.0 if exact else 1e-5)


def test_float32_kimi_round_trips_exactly(tmp_path):
    hf_model = transformers.KimiLinearForCausalLM(kimi_linear_config())
    _perturb(hf_model, seed=1)
    model = from_hf(hf_model)  # remembers transformers' dtypes and token ids
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    loaded = load(save_pretrained(model, tmp_path / "kimi"))
    for key, tensor in to_hf_state_dict(model).items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert loaded.config.pad_token_id == hf_model.config.pad_token_id == model.embed_tokens.padding_idx
    out, _ = harts_log_probs(model, TRAJECTORIES, chunk_size=4, capacity=12)
    again, _ = harts_log_probs(from_hf(loaded), TRAJECTORIES, chunk_size=4, capacity=12)
    assert max_log_prob_diff(out.log_probs, again.log_probs) == 0.0


def test_refuses_to_overwrite_what_it_did_not_write(tmp_path):
    model = trained_model("qwen3_next", torch.float32)
    foreign = tmp_path / "user"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(HFModelError, match="notes.txt"):
        save_pretrained(model, foreign)
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1
    hub = tmp_path / "hub"
    load_source = transformers.Qwen3NextForCausalLM(qwen3_next_config())
    load_source.save_pretrained(hub)  # a real transformers checkpoint HARTS did not write
    before = {p.name: p.read_bytes() for p in hub.iterdir()}
    with pytest.raises(HFModelError, match="generation_config.json"):
        save_pretrained(model, hub)
    assert {p.name: p.read_bytes() for p in hub.iterdir()} == before
    same_names = tmp_path / "same-names"  # exactly our two file names, but transformers wrote them
    same_names.mkdir()
    for name in ("config.json", "model.safetensors"):
        (same_names / name).write_bytes(before[name])
    with pytest.raises(HFModelError, match="not written by HARTS"):
        save_pretrained(model, same_names)
    assert (same_names / "model.safetensors").read_bytes() == before["model.safetensors"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(HFModelError, match="not a directory"):
        save_pretrained(model, a_file)
    # an empty directory and our own checkpoint are replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    save_pretrained(model, empty)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_pretrained(model, empty)
    assert torch.equal(load(empty).lm_head.weight, model.lm_head.weight)
    assert json.loads((empty / "config.json").read_text())["architectures"] == ["Qwen3NextForCausalLM"]
    assert not [p for p in tmp_path.iterdir() if ".harts-tmp-" in p.name]
