"""harts.integrations.trl against TRL 1.16's own GRPOTrainer, both training for real.

The same tiny Qwen3-Next / Kimi Linear model (saved and reloaded, so TRL builds its reference
model from the path as it does for a hub model), the same prompts, seed and reward function:
stock ``GRPOTrainer.train()`` and ``HartsGRPOTrainer.train()`` run three optimizer steps
(two generation batches; ``num_iterations=2`` makes TRL take the old-policy pass, ``beta > 0``
the reference pass, and the MoE router aux loss is on). They must sample the same
completions, log the same losses, KL, entropies and aux losses, and end with the same
parameters, to float32 round-off; the model object the HARTS trainer holds is the one the
caller passed in, and its weights moved. The HARTS run never calls the transformers forward
for log-probs (TRL's fused head), and compiles one plan per generation batch, which the old,
reference and policy passes share. SGD, because Adam's first steps divide by the gradient's
own magnitude and would turn round-off in near-zero gradients into full-size updates.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from datasets import Dataset  # noqa: E402
from datasets.table import InMemoryTable  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from harts.integrations.engine import IntegrationError  # noqa: E402
from harts.integrations.trl import HartsGRPOConfig, HartsGRPOTrainer  # noqa: E402
from tests.helpers.hf import KIMI, QWEN, _finish, kimi_linear_config, qwen3_next_config  # noqa: E402

VOCAB = 48
EOS_IDS = [2, 7, 13, 19, 31, 37]  # several stop tokens: completions of many lengths, right padding
LOGGED = ("loss", "kl", "entropy", "aux_loss")


def tokenizer(pad_id: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "t0".."t47" (token "tN" is id N)."""
    vocabulary = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=f"t{pad_id}", eos_token="t2", unk_token="t3")


def saved_model(architecture: str, folder) -> str:
    torch.manual_seed(0)
    if architecture == "qwen3_next":
        model = QWEN.Qwen3NextForCausalLM(qwen3_next_config(eos_token_id=2))
    else:
        model = KIMI.KimiLinearForCausalLM(kimi_linear_config(eos_token_id=2))
    model = _finish(model, torch.float32, seed=0, slow_decay=True)
    model.generation_config.eos_token_id = EOS_IDS
    model.save_pretrained(folder)
    return str(folder)


def load(architecture: str, path: str):
    module = QWEN.Qwen3NextForCausalLM if architecture == "qwen3_next" else KIMI.KimiLinearForCausalLM
    return module.from_pretrained(path, attn_implementation="eager")


def prompts() -> Dataset:
    """Eight prompts of 3 to 6 tokens (left padding), each sampled four times (shared prefixes).

    Built with a fixed fingerprint: ``Dataset.from_dict`` fingerprints the table by pickling it with
    dill, which fails on the GPU machine's Python 3.12 (datasets 5.2.0, dill 0.4.1, pyarrow 26.0.1:
    "Can't pickle <class 'MonthDayNano'>"); the fingerprint is only a cache key.
    """
    text = [" ".join(f"t{(7 * i + 3 * j) % 40 + 5}" for j in range(3 + i % 4)) for i in range(8)]
    return Dataset(InMemoryTable.from_pydict({"prompt": text}), fingerprint="harts-test-trl-prompts")


class SeededReward:
    """A reward that is a fixed hash of the completion's tokens; records every completion it scores."""

    __name__ = "seeded_reward"

    def __init__(self):
        self.completions: list[list[list[int]]] = []

    def __call__(self, completions, completion_ids, **_):
        self.completions.append([list(ids) for ids in completion_ids])
        return [((sum(ids) + 31 * len(ids)) * 2654435761 % 97) / 97 for ids in completion_ids]


def train(architecture, path, output_dir, *, harts: bool, device: str = "cpu"):
    """Three SGD steps of GRPO; returns (logs per step, completions, the model passed in, its initial state, trainer)."""
    model = load(architecture, path)
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    reward = SeededReward()
    options = dict(
        output_dir=str(output_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=10,
        max_steps=3, num_iterations=2, learning_rate=0.05, optim="sgd", beta=0.05, seed=3, bf16=False,
        use_cpu=device == "cpu", report_to=[], logging_steps=1, save_strategy="no",
        # Kimi's config declares no coefficient; transformers before 5.24 declares no output_router_logits for
        # Kimi Linear either, and TRL then refuses any coefficient (no aux loss to weight)
        router_aux_loss_coef=(0.01 if architecture == "kimi_linear"
                              and hasattr(model.config.get_text_config(), "output_router_logits") else None),
    )
    if harts:
        trainer = HartsGRPOTrainer(
            model=model, reward_funcs=reward, args=HartsGRPOConfig(**options, harts_chunk_size=8),
            train_dataset=prompts(), processing_class=tokenizer(model.config.pad_token_id),
        )
    else:
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=reward, args=trl.GRPOConfig(**options),
            train_dataset=prompts(), processing_class=tokenizer(model.config.pad_token_id),
        )
    fused_calls = []
    patched = trainer.model.forward

    def counting_forward(*args, **kwargs):
        if kwargs.get("fused_lm_head"):
            fused_calls.append(1)
        return patched(*args, **kwargs)

    trainer.model.forward = counting_forward
    trainer.train()
    logs = [{k: entry[k] for k in LOGGED if k in entry} for entry in trainer.state.log_history if "loss" in entry]
    return logs, reward.completions, model, initial, trainer, len(fused_calls)


def check_same_training(architecture, tmp_path, device, *, value_bound, parameter_bound):
    path = saved_model(architecture, tmp_path / "model")
    stock_logs, stock_completions, stock_model, initial, _, stock_fused = train(architecture, path, tmp_path / "stock", harts=False, device=device)
    logs, completions, model, harts_initial, trainer, fused = train(architecture, path, tmp_path / "harts", harts=True, device=device)

    assert len(stock_completions) == 2 and completions == stock_completions  # two generation batches, same samples
    assert len({len(c) for batch in completions for c in batch}) > 1  # completions of several lengths
    assert stock_fused > 0 and fused == 0  # TRL's log-prob forward ran in the stock run only
    assert trainer._harts.plans.compiles == 2  # one plan per generation batch: old, reference and policy passes share it

    assert len(logs) == len(stock_logs) == 3
    for step, (got, want) in enumerate(zip(logs, stock_logs)):
        # aux_loss is logged only where the router coefficient could be set (see train)
        assert set(got) == set(want) and set(want) >= set(LOGGED) - {"aux_loss"}, step
        assert "aux_loss" in want or architecture == "kimi_linear", step
        for key in sorted(want):
            error = abs(got[key] - want[key])
            print(f"step {step} {key}: {want[key]:.6g}, HARTS off by {error:.2e}")
            assert error <= value_bound * max(1.0, abs(want[key])), (step, key, got[key], want[key])
    assert stock_logs[-1]["kl"] > 0  # the reference pass took part

    assert trainer.model is model  # the trainer holds the caller's model object ...
    final = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    stock_final = {name: tensor.detach().cpu() for name, tensor in stock_model.state_dict().items()}
    moved = max(float((final[name] - harts_initial[name]).abs().max()) for name in final)
    assert moved > 1e-3  # ... whose weights HARTS trained
    worst = 0.0
    for name, tensor in final.items():
        assert torch.equal(harts_initial[name], initial[name]), name
        change = float((stock_final[name] - initial[name]).abs().max())
        error = float((tensor - stock_final[name]).abs().max())
        worst = max(worst, error)
        assert error <= parameter_bound * max(1.0, float(initial[name].abs().max())), (name, error)
        assert error <= max(1e-3 * change, parameter_bound), (name, error, change)
    print(f"parameters: largest move {moved:.3g}, largest difference from TRL's {worst:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
def test_harts_grpo_trains_as_trl_grpo_on_cpu(architecture, tmp_path):
    check_same_training(architecture, tmp_path, "cpu", value_bound=1e-5, parameter_bound=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
def test_harts_grpo_trains_as_trl_grpo_on_gpu(architecture, tmp_path, monkeypatch):
    # float32 without TF32 (cuDNN convolutions use it by default): HARTS' fused kernels against
    # transformers' torch path, so a looser bound than on CPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    check_same_training(architecture, tmp_path, "cuda", value_bound=1e-4, parameter_bound=1e-4)


def test_peft_and_bad_options_are_refused(tmp_path):
    path = saved_model("qwen3_next", tmp_path / "model")
    model = load("qwen3_next", path)
    common = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, bf16=False,
                  use_cpu=True, report_to=[])
    with pytest.raises(IntegrationError, match="peft_config"):
        HartsGRPOTrainer(model=model, reward_funcs=SeededReward(), args=HartsGRPOConfig(**common),
                         train_dataset=prompts(), processing_class=tokenizer(1), peft_config=object())
    with pytest.raises(IntegrationError, match="harts_chunk_size"):
        HartsGRPOTrainer(model=model, reward_funcs=SeededReward(), args=HartsGRPOConfig(**common, harts_chunk_size=0),
                         train_dataset=prompts(), processing_class=tokenizer(1))


def test_a_model_harts_cannot_compute_is_refused_when_the_trainer_is_built(tmp_path):
    path = saved_model("qwen3_next", tmp_path / "model")
    model = load("qwen3_next", path)
    model.model.adapter = torch.nn.Linear(2, 2)  # state the architecture does not have
    args = HartsGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           bf16=False, use_cpu=True, report_to=[])
    with pytest.raises(Exception, match="model.adapter"):
        HartsGRPOTrainer(model=model, reward_funcs=SeededReward(), args=args, train_dataset=prompts(),
                         processing_class=tokenizer(1))


def test_use_harts_false_is_stock_trl(tmp_path):
    path = saved_model("kimi_linear", tmp_path / "model")
    model = load("kimi_linear", path)
    args = HartsGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           bf16=False, use_cpu=True, report_to=[], use_harts=False)
    trainer = HartsGRPOTrainer(model=model, reward_funcs=SeededReward(), args=args, train_dataset=prompts(),
                               processing_class=tokenizer(0))
    assert trainer._harts is None
    ids = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 12, 0]])
    mask = (torch.arange(5) >= 1).long()[None].repeat(2, 1)
    mask[1] = torch.tensor([1, 1, 1, 1, 0])
    got, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
    want, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, 3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
def test_the_replaced_method_returns_what_trls_returns(architecture, tmp_path):
    """TRL's contract of ``_get_per_token_logps_and_entropies`` on left/right-padded rows at temperature 0.7.

    The same trainer, the same model: HARTS' override against TRL's own method (its fused LM
    head), values and the gradients of a random weighting of log-probs, entropies and aux loss.
    """
    path = saved_model(architecture, tmp_path / "model")
    model = load(architecture, path)
    args = HartsGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           bf16=False, use_cpu=True, report_to=[], temperature=0.7, harts_chunk_size=8,
                           router_aux_loss_coef=0.01)
    trainer = HartsGRPOTrainer(model=model, reward_funcs=SeededReward(), args=args, train_dataset=prompts(),
                               processing_class=tokenizer(model.config.pad_token_id))
    generator = torch.Generator().manual_seed(5)
    prompt_lengths, completion_lengths, width = [4, 7, 7, 2], [6, 1, 9, 0], (7, 9)
    ids = torch.randint(3, VOCAB, (4, sum(width)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[row, width[0] - p : width[0] + c] = 1
    weights = torch.randn(3, 4, width[1], generator=generator)

    def run(method):
        model.zero_grad(set_to_none=True)
        logps, entropies, aux = method(trainer, trainer.model, ids, mask, width[1], compute_entropy=True, compute_aux_loss=True)
        ((weights[0] * logps).sum() + (weights[1] * entropies).sum() + 3.0 * aux).backward()
        return logps.detach(), entropies.detach(), aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got = run(HartsGRPOTrainer._get_per_token_logps_and_entropies)
    want = run(trl.GRPOTrainer._get_per_token_logps_and_entropies)
    completion = mask[:, width[0]:].bool()
    for value, expected in zip(got[:2], want[:2]):
        assert torch.equal(value[~completion], torch.zeros_like(value[~completion]))  # padding is 0, as in TRL
        assert float((value - expected).abs().max()) <= 2e-5
    assert abs(float(got[2]) - float(want[2])) <= 1e-5 * float(want[2])
    assert set(got[3]) == set(want[3])
    for name, grad in got[3].items():
        assert float((grad - want[3][name]).abs().max()) <= 1e-4 * max(1.0, float(want[3][name].abs().max())), name
