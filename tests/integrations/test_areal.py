"""harts.integrations.areal against AReaL 1.0.4 itself (installed --no-deps, CPU).

Both engines are AReaL's ``FSDPPPOActor`` built by its own ``__init__`` and
``create_process_group`` on a one-process gloo group, handed the transformers model unsharded
(``initialize`` would shard it with FSDP2 on an accelerator) and an SGD optimizer with learning
rate 0, so the gradients ``train_batch`` leaves behind can be compared. The batch is what
``PPOActor.ppo_update`` hands ``train_batch``: AReaL's ``list[dict]`` workflow output through the
real ``PPOActor.compute_advantages`` (loss mask and log-probs rolled by -1), with
``grpo_loss_fn`` and the loss weight ``_ppo_update`` passes. The stock engine packs one trajectory
per micro-batch (``n_mbs`` = batch size) and runs the model with SDPA: on CPU, transformers has no
varlen attention, so that is where AReaL's own computation is exact.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("areal")

from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig  # noqa: E402
from areal.api.alloc_mode import ParallelStrategy  # noqa: E402
from areal.engine.fsdp_engine import FSDPPPOActor  # noqa: E402
from areal.trainer.ppo.actor import grpo_loss_fn  # noqa: E402
from areal.utils.functional import ppo_actor_loss_fn  # noqa: E402

from harts.errors import RolloutInputError  # noqa: E402
from harts.integrations.areal import HartsPPOActor  # noqa: E402
from harts.interop import from_areal, to_layout  # noqa: E402
from harts.models import from_hf  # noqa: E402
from harts.runtime import log_probs_baseline  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers import agent_episodes, areal_padded, areal_rows, fixed_episodes  # noqa: E402
from tests.helpers.hf import reference_log_probs, tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread", "gloo_world_of_one")


@functools.lru_cache(maxsize=None)
def hf_model(architecture: str):
    model = tiny_hf_model(architecture, torch.float32)
    model.config._attn_implementation = "sdpa"  # causal without a mask: the packed forward AReaL's engine runs
    return model


class OneSequence(torch.nn.Module):
    """The stock engine's model call, for micro-batches of one trajectory on CPU.

    AReaL 1.0.4 calls the model with the packed micro-batch: ``cu_seqlens`` / ``cu_seq_lens_q`` and
    ``attention_mask=dict(full_attention=None, sliding_attention=None)``, which transformers'
    Qwen3-Next / Kimi Linear refuse on CPU (no varlen conv kernel; no ``linear_attention`` mask
    entry). A micro-batch of one trajectory (plus trailing padding) needs neither: this passes its
    ``input_ids`` and ``position_ids``, under the causal mask transformers builds.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, **_):
        assert cu_seqlens is None or len(cu_seqlens) <= 3  # one trajectory, at most one padding sequence
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)


def actor(cls, model, tmp_path, n_mbs: int, max_tokens: int | None = None):
    model.config.save_pretrained(tmp_path)  # AReaL's engine reads the model config from its path
    config = PPOActorConfig(
        experiment_name="harts", trial_name="test", path=str(tmp_path), temperature=1.0,
        mb_spec=MicroBatchSpec(n_mbs=n_mbs, max_tokens_per_mb=max_tokens),
        optimizer=OptimizerConfig(gradient_clipping=1e9), eps_clip=0.2, recompute_logprob=False, use_decoupled_loss=False,
        kl_ctl=0.0, adv_norm=None, reward_norm=None,
    )
    engine = cls(config)
    engine.create_process_group(parallel_strategy=ParallelStrategy())
    engine.model = model if cls is HartsPPOActor else OneSequence(model)
    engine.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    engine.device = torch.device("cpu")
    return engine


def episodes_of(seed: int):
    """Two prompts: a trunk and two rollouts forking off it, and a trunk and one (what the plan shares)."""
    episodes = fixed_episodes(seed=seed)
    return [episodes[i] for i in (0, 1, 2, 4, 5)]


def workflow_output(model, episodes, seed: int) -> list[dict[str, torch.Tensor]]:
    """AReaL's list[dict]: one trajectory per dict, [1, S] tensors, token-aligned inference log-probs."""
    rng = np.random.default_rng(seed)
    true = [lp.detach().numpy() for lp in reference_log_probs(model, [tokens for tokens, _, _ in episodes])]
    sampled = [lp + rng.normal(scale=0.2, size=lp.shape) for lp in true]
    out = []
    for row in areal_rows(episodes, sampled):
        item = {key: torch.as_tensor(value)[None] for key, value in row.items() if key != "rewards"}
        item["attention_mask"] = torch.ones_like(item["input_ids"])
        item["rewards"] = torch.as_tensor([float(rng.normal())])
        out.append(item)
    return out


def loss_function(config):
    """The loss PPOActor._ppo_update hands train_batch."""
    return functools.partial(
        grpo_loss_fn, eps_clip=config.eps_clip, eps_clip_higher=config.eps_clip_higher, c_clip=config.c_clip,
        rejection_sampling=config.rejection_sampling, m2_threshold=None, importance_sampling_level=config.importance_sampling_level,
        current_version=0, prox_logp_method=config.prox_logp_method, use_sapo_loss=False, use_decoupled_loss=False,
    )


def loss_weight(x):
    return x["loss_mask"].count_nonzero()


def gradients(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
@pytest.mark.parametrize("max_tokens", [None, 60])
def test_harts_train_batch_matches_areals_engine_on_grpo_loss(architecture, max_tokens, tmp_path):
    model = hf_model(architecture)
    episodes = episodes_of(seed=1)
    stock = actor(FSDPPPOActor, model, tmp_path / "stock", n_mbs=len(episodes))
    batch = stock.compute_advantages(workflow_output(model, episodes, seed=2))  # rolls loss_mask / logprobs by -1
    stock_stats = stock.train_batch(batch, loss_fn=loss_function(stock.config), loss_weight_fn=loss_weight)
    stock.export_stats()  # as AReaL's trainer does after every step: the loss's statistics are per step
    assert stock_stats["num_micro_batches"] == len(episodes)
    want = gradients(model)

    ours = actor(HartsPPOActor, model, tmp_path / "ours", n_mbs=1, max_tokens=max_tokens)
    stats = ours.train_batch(batch, loss_fn=loss_function(ours.config), loss_weight_fn=loss_weight)
    ours.export_stats()
    got = gradients(model)
    assert stats["grad_norm"] == pytest.approx(stock_stats["grad_norm"], rel=1e-4)
    assert set(got) == set(want)
    scale = max(float(g.abs().max()) for g in want.values())
    for name, grad in want.items():
        assert float((got[name] - grad).abs().max()) <= 1e-4 * scale + 1e-7, name
    if max_tokens is not None:
        assert stats["num_micro_batches"] > 1

    # forward_batch: AReaL's next-token log-probs, [B, max len] (the last entry of each scores nothing)
    ours_logp = ours.forward_batch(batch)
    stock_logp = stock.forward_batch(batch)
    for item, mine, theirs in zip(batch, ours_logp, stock_logp):
        n = int(item["attention_mask"].sum())
        mine, theirs = mine.reshape(-1), theirs.reshape(-1)
        assert float((mine[: n - 1] - theirs[: n - 1]).abs().max()) <= 1e-4


# ------------------------------------------------------------------------------- silent misuse cases


def test_areal_layout_is_what_areals_loss_reads(tmp_path):
    """to_layout(out, batch, "areal") beside the rolled loss mask gives ppo_actor_loss_fn AReaL's own loss."""
    model = hf_model("qwen3_next")
    episodes = episodes_of(seed=3)
    engine = actor(FSDPPPOActor, model, tmp_path, n_mbs=len(episodes))
    batch = engine.compute_advantages(workflow_output(model, episodes, seed=4))
    packed = {key: torch.cat([item[key][0, : int(item["attention_mask"].sum())] for item in batch])
              for key in ("loss_mask", "logprobs", "advantages")}
    imported = from_areal(batch, rolled=True)
    out = log_probs_baseline(from_hf(model), imported)
    theirs = torch.cat([torch.cat([lp, lp.new_zeros(1)]) for lp in reference_log_probs(model, [t for t, _, _ in episodes])])

    def loss(logprobs):
        return ppo_actor_loss_fn(logprobs=logprobs, old_logprobs=packed["logprobs"], advantages=packed["advantages"],
                                 eps_clip=0.2, loss_mask=packed["loss_mask"].bool(), proximal_logprobs=packed["logprobs"])[0]

    assert float(loss(to_layout(out, imported, "areal"))) == pytest.approx(float(loss(theirs)), rel=1e-5)


def test_from_areal_reads_list_of_dicts_and_is_told_whether_it_was_rolled(tmp_path):
    model = hf_model("qwen3_next")
    episodes = episodes_of(seed=5)
    rows = workflow_output(model, episodes, seed=6)
    before = from_areal(rows, rolled=False)
    assert before.trajectory_fields["prompt_length"].tolist() == [p for _, _, p in episodes]
    engine = actor(FSDPPPOActor, model, tmp_path, n_mbs=1)
    rolled = [{k: v for k, v in item.items() if k != "advantages"} for item in engine.compute_advantages(rows)]
    after = from_areal(rolled, rolled=True)  # no advantages left to guess from: the prompt lengths still hold
    assert after.trajectory_fields["prompt_length"].tolist() == [p for _, _, p in episodes]
    assert [m.tolist() for m in after.loss_mask] == [m.tolist() for m in before.loss_mask]
    with pytest.raises(TypeError):
        from_areal(rows)  # noqa: the caller must say
    with pytest.raises(RolloutInputError, match="rolled= must be True or False"):
        from_areal(rows, rolled=None)
    with pytest.raises(RolloutInputError, match="entry 1: keys differ"):
        from_areal([rows[0], {k: v for k, v in rows[1].items() if k != "versions"}], rolled=False)


@settings(max_examples=30, deadline=None)
@given(episodes=agent_episodes(), group=st.integers(1, 3), rolled=st.booleans())
def test_list_of_dicts_imports_as_the_concatenated_batch(episodes, group, rolled):
    """AReaL's list[dict] (groups of ``group`` right-padded rows each) reads as its concat_padded_tensors."""
    rng = np.random.default_rng(len(episodes))
    rows = areal_rows(episodes, [rng.normal(size=len(tokens) - 1) for tokens, _, _ in episodes])
    items = []
    for start in range(0, len(rows), group):
        padded = areal_padded(rows[start : start + group])
        items.append({key: torch.as_tensor(value) for key, value in padded.items()})
    whole = areal_padded(rows)
    want, got = from_areal(whole, rolled=rolled), from_areal(items, rolled=rolled)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    for key in want.token_fields:
        assert all(np.array_equal(a, b) for a, b in zip(got.token_fields[key], want.token_fields[key])), key
    assert np.array_equal(got.trajectory_fields["rewards"], want.trajectory_fields["rewards"])
    assert np.array_equal(got.trajectory_fields["prompt_length"], want.trajectory_fields["prompt_length"])
