"""harts.integrations.verl against verl 0.9.1 itself (installed --no-deps, CPU).

The reference is verl's stock engine computation: ``FSDPEngineWithLMHead.forward_backward_batch``
(its micro-batching, ``prepare_model_inputs`` / ``prepare_model_outputs`` and
``logprobs_from_logits``) on the same transformers model. verl's FSDP engine cannot build and
shard its model on one CPU process (``initialize`` loads through ``HFModelConfig`` and wraps it in
FSDP on an accelerator), so both engines are constructed by verl's own ``__init__`` (device mesh,
configs) on a one-process gloo group and handed the transformers model as ``module`` unsharded,
as ``_build_model_optimizer`` would leave it with world size 1. Both are called as verl's
``TrainingWorker.train_batch`` calls an engine: the worker-side batch after
``left_right_2_no_padding``, the worker's default keys, and ``partial(ppo_loss, config=actor_config)``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.plugin.platform import platform_manager  # noqa: E402
from verl.plugin.platform.platform_cuda import PlatformCUDA  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from harts.errors import RolloutInputError  # noqa: E402
from harts.integrations.verl import BACKEND, HartsEngine, worker_batch  # noqa: E402
from harts.interop import from_verl  # noqa: E402
from hypothesis import given, settings  # noqa: E402

from tests.helpers import agent_episodes, fixed_episodes, verl_batch  # noqa: E402
from tests.helpers.hf import reference_log_probs, tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread", "gloo_world_of_one")


class CPUPlatform(PlatformCUDA):
    """verl 0.9.1 knows CUDA, NPU and ROCm platforms only: the same calls, answered for the CPU."""

    @property
    def device_name(self) -> str:
        return "cpu"

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"

    def communication_backend_name(self) -> str:
        return "gloo"


@pytest.fixture(scope="module", autouse=True)
def cpu_platform():
    previous = platform_manager._current_platform
    platform_manager.set_platform(CPUPlatform())
    yield
    platform_manager._current_platform = previous


@functools.lru_cache(maxsize=None)
def hf_model(architecture: str):
    return tiny_hf_model(architecture, torch.float32)


class _ModelConfig(dict):
    """What verl's engine reads of ``HFModelConfig`` (the model itself is handed over built)."""

    use_remove_padding = False
    lora_rank = 0
    enable_activation_offload = False


def engine(cls, model, *, strategy: str):
    engine_config = FSDPEngineConfig(use_torch_compile=False, use_remove_padding=False)
    object.__setattr__(engine_config, "strategy", strategy)
    built = cls(_ModelConfig(), engine_config, FSDPOptimizerConfig(lr=1e-3), None)
    built.module = model
    built._autocast_dtype = torch.float32  # param_dtype fp32: verl's forward_step skips autocast
    return built


def actor_config(loss_agg_mode: str, batch_size: int) -> FSDPActorConfig:
    return FSDPActorConfig(
        strategy="fsdp", rollout_n=1, ppo_mini_batch_size=batch_size, ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode=loss_agg_mode, entropy_coeff=0.01, use_kl_loss=False, clip_ratio=0.2,
    )


def worker_side(model, episodes, *, seed: int, dynamic: bool, max_tokens: int):
    """The TensorDict verl's TrainingWorker.train_batch hands its engine for an actor update."""
    rng = np.random.default_rng(seed)
    true = [lp.detach().numpy() for lp in reference_log_probs(model, [tokens for tokens, _, _ in episodes])]
    old = [lp + rng.normal(scale=0.2, size=lp.shape) for lp in true]
    padded = verl_batch(episodes, old, seed=seed)
    uid = padded.pop("uid")
    proto = DataProto.from_single_dict({key: torch.as_tensor(value) for key, value in padded.items()} | {"uid": uid},
                                       meta_info={"temperature": 1.0})
    data = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(data, calculate_entropy=True, global_batch_size=len(episodes), compute_loss=True,
                         use_remove_padding=False, use_dynamic_bsz=dynamic, max_token_len_per_gpu=max_tokens,
                         micro_batch_size_per_gpu=2, use_fused_kernels=False,
                         return_model_output=True)  # so the stock engine keeps its outputs for the comparison
    return data


def forward_backward(built, model, data, loss_function):
    model.zero_grad(set_to_none=True)
    output = built.forward_backward_batch(data.clone(), loss_function=loss_function, forward_only=False)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return output, grads


@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
@pytest.mark.parametrize("loss_agg_mode, dynamic", [("token-mean", False), ("seq-mean-token-mean", True), ("seq-mean-token-sum", False)])
def test_harts_engine_matches_verls_engine_on_ppo_loss(architecture, loss_agg_mode, dynamic):
    model = hf_model(architecture)
    episodes = fixed_episodes(seed=1)
    data = worker_side(model, episodes, seed=3, dynamic=dynamic, max_tokens=60)
    loss_function = functools.partial(ppo_loss, config=actor_config(loss_agg_mode, len(episodes)))

    stock, stock_grads = forward_backward(engine(FSDPEngineWithLMHead, model, strategy="fsdp2"), model, data, loss_function)
    ours_engine = engine(HartsEngine, model, strategy=BACKEND)
    ours, ours_grads = forward_backward(ours_engine, model, data, loss_function)

    # every micro-batch loss is normalised by the global batch, so their sums are the batch loss
    assert sum(ours["loss"]) == pytest.approx(sum(stock["loss"]), rel=2e-5, abs=1e-6)
    assert set(ours_grads) == set(stock_grads)
    scale = max(float(g.abs().max()) for g in stock_grads.values())
    for name, grad in stock_grads.items():
        assert float((ours_grads[name] - grad).abs().max()) <= 1e-4 * scale + 1e-7, name
    # the model outputs are verl's nested next-token log-probs and entropies, in the batch's order
    for key in ("log_probs", "entropy"):
        for got, want in zip(ours["model_output"][key].unbind(), stock["model_output"][key].unbind()):
            assert got.shape == want.shape
            assert float((got[:-1] - want[:-1]).abs().max()) <= 1e-4, key  # the last entry scores nothing
    if dynamic:
        assert len(ours["loss"]) > 1  # the capacity split the plan into several microbatches
    assert ours_engine.harts_model() is ours_engine.harts_model()  # built once, refreshed per batch


def test_infer_batch_gives_verls_old_log_probs():
    """compute_log_prob / compute_ref_log_prob: infer_batch without a loss, the output verl pads back itself."""
    from verl.workers.utils.padding import no_padding_2_padding

    model = hf_model("qwen3_next")
    episodes = fixed_episodes(seed=7)
    data = worker_side(model, episodes, seed=8, dynamic=False, max_tokens=60)
    stock = engine(FSDPEngineWithLMHead, model, strategy="fsdp2").infer_batch(data.clone())
    ours = engine(HartsEngine, model, strategy=BACKEND).infer_batch(data.clone())
    for key in ("log_probs", "entropy"):
        got = no_padding_2_padding(ours["model_output"][key], data)  # what the trainer stores as old_log_probs
        want = no_padding_2_padding(stock["model_output"][key], data)
        mask = data["response_mask"].bool()
        assert float((got - want)[mask].abs().max()) <= 1e-4, key


def test_the_engine_keeps_verls_fsdp2_wrapping_and_names_what_it_cannot_run_yet():
    import copy

    from harts.integrations.engine import IntegrationError

    built = engine(HartsEngine, copy.deepcopy(hf_model("qwen3_next")), strategy=BACKEND)
    object.__setattr__(built.engine_config, "mixed_precision", {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    built.module = built._build_fsdp_module(built.module)  # verl's own FSDP2 path (fully_shard), under strategy=harts
    assert built.engine_config.strategy == BACKEND
    assert type(next(built.module.parameters())).__name__ == "DTensor"
    with pytest.raises(IntegrationError, match="sharded"):
        built.harts_model()


def test_engine_is_registered_as_verl_registers_engines(monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    assert EngineRegistry.get_engine_cls("language_model", BACKEND) is HartsEngine
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    assert EngineRegistry.get_engine_cls("language_model", BACKEND) is HartsEngine


def test_actor_strategy_reaches_the_engine_config():
    config = FSDPActorConfig(strategy=BACKEND, rollout_n=1, ppo_micro_batch_size_per_gpu=2)
    assert config.engine.strategy == BACKEND  # what TrainingWorker passes to EngineRegistry.new


# ------------------------------------------------------------------------- from_verl on verl's own forms


def _padded(episodes, seed=0):
    rng = np.random.default_rng(seed)
    values = [rng.normal(size=len(tokens) - 1) for tokens, _, _ in episodes]
    padded = verl_batch(episodes, values, seed=seed)
    uid = padded.pop("uid")
    return padded, uid


def _same(a, b):
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    assert sorted(a.token_fields) == sorted(b.token_fields)
    for key in a.token_fields:
        assert all(np.array_equal(x, y) for x, y in zip(a.token_fields[key], b.token_fields[key])), key
    for key in b.trajectory_fields:
        assert np.array_equal(a.trajectory_fields[key], b.trajectory_fields[key]), key


def test_from_verl_reads_dataproto_tensordict_and_the_worker_side_nested_batch():
    episodes = fixed_episodes(seed=2)
    padded, uid = _padded(episodes)
    want = from_verl(padded | {"uid": uid})
    proto = DataProto.from_single_dict({key: torch.as_tensor(value) for key, value in padded.items()} | {"uid": uid},
                                       meta_info={"temperature": 0.7})
    _same(from_verl(proto), want)
    _same(from_verl(proto.to_tensordict()), want)
    _same(worker_batch(left_right_2_no_padding(proto.to_tensordict())), want)


@settings(max_examples=30, deadline=None)
@given(episodes=agent_episodes())
def test_the_worker_side_batch_of_any_episodes_imports_as_the_padded_one(episodes):
    padded, uid = _padded(episodes)
    proto = DataProto.from_single_dict({key: torch.as_tensor(value) for key, value in padded.items()} | {"uid": uid})
    _same(worker_batch(left_right_2_no_padding(proto.to_tensordict())), from_verl(padded | {"uid": uid}))


def test_from_verl_reads_fully_nested_prompts_and_responses():
    episodes = fixed_episodes(seed=4)
    padded, uid = _padded(episodes)
    want = from_verl(padded)
    nested = {}
    for b, (tokens, _, prompt) in enumerate(episodes):
        response = len(tokens) - prompt
        nested.setdefault("input_ids", []).append(torch.as_tensor(tokens))
        nested.setdefault("prompts", []).append(torch.as_tensor(tokens[:prompt]))
        nested.setdefault("responses", []).append(torch.as_tensor(tokens[prompt:]))
        for key in ("response_mask", "old_log_probs", "advantages"):
            nested.setdefault(key, []).append(torch.as_tensor(padded[key][b, :response]))
    d = {key: torch.nested.as_nested_tensor(rows, layout=torch.jagged) for key, rows in nested.items()}
    _same(from_verl(d), want)


def test_from_verl_names_a_nested_field_that_fits_no_row():
    episodes = fixed_episodes(seed=5)
    padded, _ = _padded(episodes)
    proto = DataProto.from_single_dict({key: torch.as_tensor(value) for key, value in padded.items()})
    data = left_right_2_no_padding(proto.to_tensordict())
    data["bad"] = torch.nested.as_nested_tensor([torch.zeros(3) for _ in episodes], layout=torch.jagged)
    with pytest.raises(RolloutInputError, match="'bad'"):
        worker_batch(data)


# ------------------------------------------------------------------------- harts convert on DataProto files


def test_convert_reads_dataproto_save_to_disk_without_running_its_pickle(tmp_path):
    import os
    import pickle

    from typer.testing import CliRunner

    import harts
    from harts.cli import app

    episodes = fixed_episodes(seed=6)
    padded, uid = _padded(episodes)
    proto = DataProto.from_single_dict({key: torch.as_tensor(value) for key, value in padded.items()} | {"uid": uid},
                                       meta_info={"temperature": 1.0})
    source = tmp_path / "batch.pkl"
    proto.save_to_disk(source)
    table = tmp_path / "table.jsonl"
    result = CliRunner().invoke(app, ["convert", str(source), "--from", "verl", "-o", str(table)])
    assert result.exit_code == 0, result.output
    assert harts.RolloutBatch.read(table).content_hash() == from_verl(proto).content_hash()

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    hostile = tmp_path / "hostile.pkl"
    proto.__getstate__ = lambda: (Payload(), {}, {})  # a DataProto whose state smuggles another object in
    hostile.write_bytes(pickle.dumps(proto))
    assert b"verl.protocol" in hostile.read_bytes()[:64]
    result = CliRunner().invoke(app, ["convert", str(hostile), "--from", "verl", "-o", str(tmp_path / "x.jsonl")])
    assert result.exit_code == 2 and "hostile.pkl" in result.output
    assert not (tmp_path / "pwned").exists()
