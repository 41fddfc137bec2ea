"""One rank of the megatron-core tests (run by tests/parallel/test_tensor_parallel.py under torchrun, gloo, CPU).

    python -m torch.distributed.run --nproc-per-node N tests/parallel/tp_worker.py TP OUT [CHECKPOINT]

For each model variant (KDA + MLA, GDN + GQA, KDA + MLA + MoE), float64, on the fork batch (forks at
chunk B-1 / B / B+1): the tensor-parallel model's per-token log-probs, entropies and gathered
gradients under the plan and under the trajectory-wise baseline, beside the single-process
native model's; then one ``Trainer.step`` per mode under DDP over the data-parallel group,
beside a single-process step. Rank 0 writes the largest differences to OUT/report.json; the
test asserts on them. With CHECKPOINT, the KDA + MLA model after its step is saved there.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

warnings.filterwarnings("ignore")

import harts  # noqa: E402
import harts.parallel  # noqa: E402
from harts.runtime import HybridConfig, HybridModel, load_balancing_loss, log_probs, log_probs_baseline, z_loss  # noqa: E402
from harts.train import TrainConfig, Trainer  # noqa: E402
from harts.train.loop import save_weights  # noqa: E402
from tests.helpers import forked_batch  # noqa: E402

#: cpu: float64 and the pure-torch kernels; cuda (the GPU tests): float32 and the fast kernels, every rank on one GPU over gloo.
DEVICE = torch.device(os.environ.get("TP_WORKER_DEVICE", "cpu"))
DTYPE = torch.float64 if DEVICE.type == "cpu" else torch.float32

VARIANTS = {
    "kda-mla": dict(linear="kda", attention="mla"),
    "gdn-gqa": dict(linear="gdn", attention="gqa", num_attention_heads=4, num_key_value_heads=2,
                    attention_output_gate=True, qk_norm=True, norm_zero_centered=True),
    # megatron-core's MoELayer (EP = 1 here: every expert on every rank), each rank routing its rows; expert bias and a shared expert
    "kda-mla-moe": dict(linear="kda", attention="mla", ffn="moe", moe_expert_bias=True, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
}


def dense_model(variant: str) -> HybridModel:
    torch.manual_seed(0)
    shape = dict(
        ffn="dense", dtype=str(DTYPE).removeprefix("torch."), vocab_size=128, layer_types=["linear", "full", "linear"],
        hidden_size=32, intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_attention_heads=2, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8,
    )
    config = HybridConfig.preset("tiny", **(shape | VARIANTS[variant]))
    return HybridModel(config).to(DEVICE)


def largest(a, b) -> float:
    """The largest difference, relative to the reference's scale where that exceeds 1 (a weight gradient
    summed over positions reaches ~35 in the vocab-parallel cases; its float32 round-off scales with it)."""
    if not a.numel():
        return 0.0
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def surrogate_loss(out) -> torch.Tensor:
    """A fixed weighting of every position's log-prob and entropy, plus the router losses (the same on every rank)."""
    weights = torch.linspace(-1.0, 1.0, out.packed.numel(), dtype=out.packed.dtype, device=out.packed.device)
    loss = (out.packed * weights).sum() + 0.3 * (out.packed_entropy * weights.flip(0)).sum()
    if out.moe.num_layers:
        loss = loss + z_loss(out.moe) + load_balancing_loss(out.moe)
    return loss


def prefix_routing(trajectories, config):
    """Replayed expert ids that depend only on each token's prefix (as one inference engine picks), distinct per token."""
    out = []
    for tokens in trajectories:
        rows = []
        for t in range(len(tokens)):
            rng = np.random.default_rng(int.from_bytes(hashlib.sha256(str(list(tokens[: t + 1])).encode()).digest()[:8], "little"))
            rows.append([rng.permutation(config.num_experts)[: config.num_experts_per_tok] for _ in range(config.num_moe_layers)])
        out.append(np.asarray(rows, dtype=np.int64).reshape(len(tokens), config.num_moe_layers, config.num_experts_per_tok))
    return out


def gradient_gap(parallel, native) -> float:
    parallel.finalize_gradients()
    gathered = parallel.full_gradients()
    return max(largest(gathered[name], p.grad) for name, p in native.named_parameters())


def compare_log_probs(parallel, native, batch, plan, mode: str) -> dict:
    def run(model):
        model.zero_grad(set_to_none=True)
        if mode == "harts":
            out = log_probs(model, plan, batch, with_entropy=True, row_chunk=7)
        else:
            out = log_probs_baseline(model, batch, microbatches=plan, with_entropy=True, row_chunk=7)
        surrogate_loss(out).backward()
        return out

    mine, want = run(parallel), run(native)
    baseline = log_probs_baseline(native, batch, microbatches=plan, with_entropy=True)
    moe = {}
    if want.moe.num_layers:
        moe = {f"moe_{field}": largest(getattr(mine.moe, field).detach(), getattr(want.moe, field).detach())
               for field in ("z_loss_sum", "prob_mass", "assign_count", "tokens")}
    return moe | {
        "log_probs": largest(mine.packed, want.packed),
        "entropy": largest(mine.packed_entropy, want.packed_entropy),
        "log_probs_vs_baseline": largest(mine.packed.detach(), baseline.packed.detach()),
        "gradients": gradient_gap(parallel, native),
        "rows": mine.rows,
    }


def compare_vocab_parallel(layout, cases: int = 24) -> dict:
    """Vocab-parallel compact log-probs / entropies and their gradients against the full-vocabulary ones."""
    from harts.numerics import compact_log_probs

    generator = torch.Generator().manual_seed(7)
    worst = {"log_probs": 0.0, "entropy": 0.0, "hidden_grad": 0.0, "weight_grad": 0.0}
    size, rank = layout.tensor_parallel_size, layout.tensor_parallel_rank
    for case in range(cases):
        rows = int(torch.randint(1, 30, (), generator=generator))
        vocab = size * int(torch.randint(1, 40, (), generator=generator))
        positions = int(torch.randint(0, 50, (), generator=generator))
        temperature = [1.0, 0.7, 1.3][case % 3]
        row_chunk = [None, 1, 5][case % 3]
        hidden = (torch.randn(rows, 16, dtype=torch.float64, generator=generator) * 2).to(DEVICE, DTYPE)
        weight = torch.randn(vocab, 16, dtype=torch.float64, generator=generator).to(DEVICE, DTYPE)
        row_of = torch.randint(0, rows, (positions,), generator=generator).to(DEVICE)
        targets = torch.randint(0, vocab, (positions,), generator=generator).to(DEVICE)
        g_lp, g_h = (torch.randn(positions, dtype=torch.float64, generator=generator).to(DEVICE, DTYPE) for _ in range(2))

        def run(h, w, parallel: bool):
            if parallel:
                shard = vocab // size
                return harts.parallel.vocab_parallel_compact_log_probs(
                    h, w[rank * shard:(rank + 1) * shard] / temperature, None, row_of, targets, vocab_start=rank * shard,
                    vocab_size=vocab, group=layout.tensor_parallel_group, with_entropy=True, row_chunk=row_chunk)
            return compact_log_probs(h, w / temperature, None, row_of, targets, with_entropy=True, row_chunk=row_chunk)

        results = []
        for parallel in (True, False):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp, entropy = run(h, w, parallel)
            ((lp * g_lp).sum() + (entropy * g_h).sum()).backward()
            grad_h = h.grad.clone()
            if parallel:  # each rank's hidden gradient is its shard's part (the row gather sums them)
                dist.all_reduce(grad_h, group=layout.tensor_parallel_group)
                dist.all_reduce(w.grad, group=layout.tensor_parallel_group)  # disjoint shard rows: the sum is the whole
            results.append((lp.detach(), entropy.detach(), grad_h, w.grad))
        for key, a, b in zip(worst, results[0], results[1]):
            worst[key] = max(worst[key], largest(a, b))
    return worst


def compare_random_trees(examples: int = 4) -> dict:
    """compare_log_probs on hypothesis rollout trees (forks around chunk boundaries), for two variants.

    Every rank must draw the same trees in the same order: derandomised, generation only (no
    shrinking, whose path could differ between ranks), no example database.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from tests.helpers.strategies import token_trees

    worst = {"log_probs": 0.0, "entropy": 0.0, "log_probs_vs_baseline": 0.0, "gradients": 0.0, "examples": 0}
    for variant in ("gdn-gqa", "kda-mla-moe"):
        native = dense_model(variant)
        parallel = harts.parallel.TensorParallelHybridModel.from_model(dense_model(variant))

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(trajectories=token_trees(chunk_size=4, max_trajectories=5, max_length=14), slack=st.integers(0, 8))
        def check(trajectories, slack):
            batch = harts.RolloutBatch.from_trajectories(trajectories)
            plan = harts.compile(batch, capacity=max(map(len, trajectories)) + slack, dp_size=1, chunk_size=4)
            found = compare_log_probs(parallel, native, batch, plan, "harts")
            for key in worst:
                worst[key] = worst[key] + 1 if key == "examples" else max(worst[key], found[key])

        check()
    return worst


def compare_training(variant, layout, batch, mode: str, checkpoint: str | None, alone, *,
                     token_dispatcher: str = "allgather", capacity: int = 60) -> dict:
    config = TrainConfig(mode=mode, epochs=2, max_grad_norm=0.5, with_entropy=True, entropy_coef=0.01, temperature=0.9,
                         aux_loss_coef=1e-2, z_loss_coef=1e-3, expert_bias_rate=1e-3)
    lr = 0.05
    native = dense_model(variant)
    single = harts.compile(batch, capacity=capacity, dp_size=1, chunk_size=4)
    want = Trainer(native, torch.optim.SGD(native.parameters(), lr=lr), config, process_group=alone).step(batch, single)

    parallel = harts.parallel.TensorParallelHybridModel.from_model(dense_model(variant), token_dispatcher=token_dispatcher)
    wrapped = parallel
    if layout.data_parallel_size > 1:  # DDP leaves the expert parameters to parallel.finalize_gradients
        wrapped = DistributedDataParallel(parallel, process_group=layout.data_parallel_group)
    plan = harts.compile(batch, capacity=capacity, dp_size=layout.data_parallel_size, chunk_size=4)
    trainer = Trainer(wrapped, torch.optim.SGD(parallel.parameters(), lr=lr), config,
                      process_group=layout.data_parallel_group)
    got = trainer.step(batch, plan)
    weights = parallel.full_state_dict()
    report = {}
    if checkpoint is not None and mode == "harts":
        save_weights(wrapped, checkpoint, rank=dist.get_rank())
        report["checkpoint_log_probs"] = log_probs(parallel, single, batch).packed.tolist()
    if native.config.num_moe_layers:
        report |= {key: max(abs(a[key] - b[key]) for a, b in zip(got.metrics, want.metrics))
                   for key in ("z_loss", "load_balancing_loss")}
    return report | {
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(got.metrics, want.metrics)),
        "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got.metrics, want.metrics)),
        "entropy": max(abs(a["entropy"] - b["entropy"]) for a, b in zip(got.metrics, want.metrics)),
        "weights": max(largest(weights[name], p.detach()) for name, p in native.state_dict(keep_vars=True).items()),
        "moved": max(largest(p.detach(), q.detach()) for p, q in zip(native.parameters(), dense_model(variant).parameters())),
    }


def save_hf_checkpoint(directory: Path, batch, plan) -> list[float]:
    """A Kimi Linear model (MLA, group-limited MoE routing, shared expert) sharded, then written as a
    transformers directory by harts.parallel.save_pretrained; returns the sharded model's log-probs."""
    from harts.models import from_hf
    from tests.helpers.hf import kimi_linear_config

    config = kimi_linear_config(vocab_size=64)
    config.dtype = DTYPE
    torch.manual_seed(2)
    parallel = harts.parallel.TensorParallelHybridModel.from_model(from_hf(config).to(DEVICE))
    harts.parallel.save_pretrained(parallel, directory)
    return log_probs(parallel, plan, batch).packed.tolist()


def main(tensor_parallel: str, out: str, checkpoint: str | None = None) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    layout = harts.parallel.initialize(tensor_parallel=int(tensor_parallel))
    batch = forked_batch(chunk=4)
    # a group of this rank alone, for the single-process reference runs (every rank creates every group)
    alone = [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    report: dict = {"tp": layout.tensor_parallel_size, "dp": layout.data_parallel_size}
    report["vocab_parallel"] = compare_vocab_parallel(layout)
    report["random_trees"] = compare_random_trees()
    for variant in VARIANTS:
        native = dense_model(variant)
        parallel = harts.parallel.TensorParallelHybridModel.from_model(dense_model(variant))
        plan = harts.compile(batch, capacity=60, dp_size=1, chunk_size=4)
        if native.config.num_moe_layers:
            replay = harts.RolloutBatch.from_trajectories(list(batch.tokens), routed_experts=prefix_routing(batch.tokens, native.config))
            replay_plan = harts.compile(replay, capacity=60, dp_size=1, chunk_size=4)
            for mode in ("harts", "baseline"):
                report[f"{variant}/{mode}/replay"] = compare_log_probs(parallel, native, replay, replay_plan, mode)
        for mode in ("harts", "baseline"):
            report[f"{variant}/{mode}/log_probs"] = compare_log_probs(parallel, native, batch, plan, mode)
            report[f"{variant}/{mode}/step"] = compare_training(variant, layout, batch, mode,
                                                               checkpoint if variant == "kda-mla" else None, alone)
    report["hf_checkpoint_log_probs"] = save_hf_checkpoint(Path(out, "kimi-hf"), batch, plan)
    if dist.get_rank() == 0:
        Path(out, "report.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
