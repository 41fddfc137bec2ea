"""Headline runtime benchmark: trajectory-wise baseline vs HARTS on a SWE-like step (paper §5.3).

Builds the model from ``HybridConfig.preset(--preset)`` (``--layers N`` keeps the first N
layers' pattern, bf16 on CUDA), generates one SWE-like rollout step, keeps whole rollout
trees until ``--tokens`` raw tokens (in generation order, or with ``--target-compression X``
the trees whose joint sharing is closest to X), compiles it with capacity ``--capacity`` and measures:

* ``baseline_fla``: F/B/Grad of the trajectory-wise baseline as a user's trainer runs it today
  (trajectories packed first-fit into microbatches of at most ``--capacity`` raw tokens, one
  packed call per operator, linear attention on stock fla ``chunk_kda``); every speedup and
  fidelity figure is against this one;
* ``baseline``: the same baseline on HARTS' own kernels (``harts.kernels.dispatch``: the fla
  pipeline with HARTS' state kernels, no exports), for ``speedup_vs_own_baseline``;
* ``harts``: F/B/Grad of the compiled plan (compact rows, one linear-attention call per
  round, boundary-state handoffs), bound to the batch once before the passes (``plan.bind_seconds``);
* ``core``: ``harts`` plus the planning time (``harts.compile`` wall clock) and the binding;
* ``sequence_at_a_time`` (ablation): the same plan with every input sequence of a round as
  its own linear-attention call (no round packing; same results as ``harts``);
* ``node_at_a_time`` (ablation): Tree Training's linear-attention schedule on the same plan
  (:class:`harts_bench.ablation.NodeAtATimeView`): one chunkwise call per node of the
  microbatch's trie (maximal fork-free token run), issued parents first, each node starting
  from the exact final state of its parent's call, no packing and no replay, so the chunk
  grid restarts at every node start (slightly different rounding from the baseline; its mean
  |delta log-prob| against the baseline is reported). Projections, convolution, MoE,
  attention and log-probs are the ``harts`` path's; only linear-attention scheduling differs.
  ``--no-ablation`` skips both ablations;
* peak memory of each, linear-attention calls per microbatch per linear-attention layer
  (``baseline`` 1, ``harts`` rounds, ``sequence_at_a_time`` input sequences,
  ``node_at_a_time`` trie nodes), non-replay compression
  (baseline rows / compact rows) and fidelity: the mean token-wise cosine of the
  full-vocabulary logits of HARTS vs the baseline, next to the baseline vs a rerun of
  itself and vs the baseline packed differently (one trajectory per call: the bf16
  rounding noise of an equally valid execution), plus the mean |delta log-prob| and
  |delta NLL|, and the cosine of the whole parameter gradient HARTS vs baseline.

F/B/Grad = per microbatch: forward with full-layer recomputation, compact-to-semantic
log-probs, GRPO loss (``harts.rl.grpo_loss``, seq-mean over the whole step, so summing
microbatches gives the step's loss) and backward; gradients accumulate over microbatches;
the interval ends before any optimizer step. Kernels come from ``harts.kernels.Dispatch``
(fla's KDA pipeline with HARTS' state kernels, varlen FlashAttention and grouped-GEMM experts
on CUDA; ``--kernels naive`` forces the pure-torch references).

``first_step_seconds``: from process start to the end of HARTS' first training step (model
build, planning, one F/B/Grad pass over the plan and one optimizer step), run before anything
else, so with an empty ``TRITON_CACHE_DIR`` it includes every kernel compilation (and fla's
autotuning where no pinned configs ship for the GPU).

Run (H200)::

    PYTHONUNBUFFERED=1 harts-bench --tokens 200000 --target-compression 5.6 --out bench_runtime.json
    PYTHONUNBUFFERED=1 harts-bench --layers 4 --out bench_runtime_l4.json

(the first is the recorded headline: 24 layers, about 5.6x compression; ``python
benchmarks/bench_runtime.py`` takes the same arguments)

CPU smoke test::

    harts-bench --device cpu --preset tiny --layers 2 --tokens 3000 --scale 0.02 --out /tmp/b.json

It prints progress and one final line ``headline-fla: compression=... speedup_vs_fla_baseline=...
core_vs_fla_baseline=... speedup_vs_own_baseline=... cosine=... first_step_seconds=...``.

``--attention-bench`` runs only the full-attention head-to-head of :mod:`harts_bench.attention`
(gathered ancestor KV + varlen FlashAttention vs a FlexAttention tree mask over one shared KV
buffer) on the same workload and plan; ``--kernel-bench`` only the linear-attention kernels:
stock fla against HARTS' call without exports, and with the exports of the plan's rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
import typer

import harts
from harts.kernels import Dispatch, host
from harts.options import DEFAULT_OPTIONS
from harts.passes.round_critical_path import round_critical_path
from harts.kernels.linear_attention import chunk as fla_chunk
from harts.rl import grpo_loss
from harts.runtime import HybridConfig, HybridModel, log_probs_baseline, microbatch_log_probs
from harts.runtime.api import bind_plan
from harts.runtime.tree_view import TreeView
from harts.runtime.view import BaselineView
from harts_bench.ablation import (
    CascadeAttentionView,
    PackedLinearRowsView,
    NodeAtATimeView,
    NoReplayView,
    TrieNodes,
    divergence_by_depth,
    fork_positions,
    handoff_depths,
)
from harts_bench.attention import format_table, run_attention_bench
from harts_bench.common import STARTED, peak_memory_gib, reset_peak_memory, say, synchronize
from harts_bench.profiling import (
    SyncSites,
    causal_attention_pairs,
    excess_over_compression,
    format_excess,
    gaps_before_kernels,
    idle_gaps,
    kernel_events,
    kernel_intervals,
    plan_attention_pairs,
    refined_limit,
    seconds_by_family,
    seconds_by_kernel,
)
from harts.rollouts.workloads import swe_like_step, trees_near_compression, with_compression
from harts_bench.train_step import headline_train_line, train_step_figures


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="harts-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ling-3.0-tiny")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    parser.add_argument("--tokens", type=int, default=200_000, help="raw-token budget of the trajectory subset")
    parser.add_argument("--scale", type=float, default=0.25,
                        help="scale of the SWE-like generator (token lengths and task count; 0.25 keeps several "
                             "whole trees within the default budget)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target-compression", type=float, default=None,
                        help="keep the whole trees whose joint sharing is closest to this ratio (within --tokens), and "
                             "lower their sharing to it when they share more (any ratio >= 1, e.g. 1.0 for no "
                             "sharing); default: whole trees in generation order")
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--plan-repeats", type=int, default=3,
                        help="compiles timed after the first; core uses their median (the first pays imports)")
    parser.add_argument("--pipeline", default=None,
                        help="harts.compile's pipeline text for the timed plan (default: the default pipeline), e.g. "
                             "'lower,prefix-compress,partition-microbatches,schedule-slots,segment,"
                             "min-call-rounds{shorten_critical_path=true},lay-out'")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_OPTIONS.chunk_size,
                        help="linear-attention chunk size B of the plan and of every kernel call")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--kernels", choices=("auto", "fast", "naive"), default="auto")
    parser.add_argument("--matmul-precision", choices=("highest", "high", "medium"), default=None,
                        help="torch.set_float32_matmul_precision; default 'high' (TF32) on CUDA, 'highest' on CPU")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-ablation", action="store_true",
                        help="skip the sequence-at-a-time and node-at-a-time ablations")
    parser.add_argument("--no-fidelity", action="store_true", help="skip the logit-cosine fidelity check")
    parser.add_argument("--no-own-baseline", action="store_true",
                        help="skip the trajectory-wise baseline on HARTS' own kernels (speedup_vs_own_baseline)")
    parser.add_argument("--no-replay-ablation", action="store_true",
                        help="skip the replay / no-replay divergence by state-handoff depth (Eq. 25-26)")
    parser.add_argument("--fidelity-rows", type=int, default=2048, help="logit rows per block in the cosine check")
    parser.add_argument("--out", default="bench_runtime.json")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel size: time the megatron-core path (harts_bench.megatron) under torchrun")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size of the megatron-core path (MoE experts split over E ranks)")
    parser.add_argument("--moe-dispatcher", choices=("allgather", "alltoall"), default="allgather",
                        help="megatron-core MoE token dispatcher of the megatron-core path")
    parser.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                        help="process-group backend of the megatron-core path (default: nccl on CUDA, gloo on CPU); "
                             "gloo lets several ranks share one GPU (NCCL refuses two ranks on one device)")
    parser.add_argument("--kernel-bench", action="store_true",
                        help="only time the linear-attention kernels (fast vs reference) at --kernel-tokens rows")
    parser.add_argument("--kernel-tokens", type=int, default=32768)
    parser.add_argument("--attention-bench", action="store_true",
                        help="only time full attention per microbatch layout: gathered ancestor KV + varlen flash "
                             "vs a FlexAttention tree mask over one shared KV buffer (harts_bench.attention)")
    parser.add_argument("--attention-repeats", type=int, default=10, help="timed calls per path in --attention-bench")
    parser.add_argument("--attention-microbatches", type=int, default=None,
                        help="time only the first N microbatches in --attention-bench (default: all)")
    parser.add_argument("--profile", nargs="?", const="both", choices=("both", "harts"), default=None,
                        help="print a torch.profiler table of one baseline and one HARTS pass (after warm-up; "
                             "'--profile harts': the HARTS pass only), their self time by operator family against "
                             "baseline / compression (profile_by_family), per-kernel tables and the device's idle gaps")
    parser.add_argument("--train-step", action="store_true",
                        help="also time harts.train.Trainer.step (what `harts train` runs) in both modes on the same "
                             "model, plan and batch, and print the headline-train line")
    parser.add_argument("--train-step-optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="the training step's optimizer, at learning rate 0: adamw (what `harts train` runs) or "
                             "sgd without momentum, which keeps no state, so that the step fits beside the pass on a "
                             "card too small for AdamW's two moments (a 7.8B model on 80 GB); F/B/Grad is timed before "
                             "the optimizer runs either way")
    parser.add_argument("--packed-linear-rows", action="store_true",
                        help="also time the HARTS pass with the linear-attention layers on the packed rows (hidden rows "
                             "gathered into round order once; harts_bench.ablation.PackedLinearRowsView) against the "
                             "default, where each round packs its own q, k, v and gate from the compact rows")
    parser.add_argument("--cascade-attention", action="store_true",
                        help="also time the HARTS pass with the full-attention layers split at the forks (own rows "
                             "in place, each shared ancestor run once per fork, merged by log-sum-exp; "
                             "harts_bench.ablation.CascadeAttentionView) against the gathered key/value views")
    parser.add_argument("--keep-linear-intermediates", action="store_true",
                        help="also time the HARTS pass with the linear-attention calls keeping w, u and the chunk "
                             "states from the checkpoint's recompute for their backward instead of recomputing them "
                             "there as fla does (kernels.linear_attention.chunk.intermediates_kept_in_recompute)")
    parser.add_argument("--sync-debug", action="store_true",
                        help="after the timed passes, count one HARTS pass's host-device synchronisations by source line")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- setup


def select_trees(batch, budget: int):
    """Whole rollout trees in generation order while they fit the raw-token budget; when even the
    first tree does not fit, its first paths up to the budget (at least one path)."""
    tree_ids = np.asarray(batch.tree_ids)
    lengths = batch.lengths
    chosen, total = [], 0
    for tree in dict.fromkeys(tree_ids.tolist()):
        members = np.flatnonzero(tree_ids == tree)
        size = int(lengths[members].sum())
        if total + size <= budget:
            chosen.extend(members.tolist())
            total += size
            continue
        if not chosen:
            for member in members:
                if chosen and total + int(lengths[member]) > budget:
                    break
                chosen.append(int(member))
                total += int(lengths[member])
        break
    return batch.subset(chosen)


def baseline_microbatches(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit-decreasing packing of whole trajectories into <= capacity raw tokens."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in np.argsort(-lengths, kind="stable"):
        size = int(lengths[index])
        for b, load in enumerate(loads):
            if load + size <= capacity:
                bins[b].append(int(index))
                loads[b] += size
                break
        else:
            bins.append([int(index)])
            loads.append(size)
    return [sorted(b) for b in bins]


def build_config(args) -> HybridConfig:
    overrides = {"dtype": args.dtype}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    return HybridConfig.preset(args.preset, **overrides)


def _lowered_to_compression(batch, args, config: HybridConfig):
    """Whole trees rarely share less than about 3.5x: below that, lower the chosen trees' sharing to
    ``--target-compression`` (``with_compression``), measured as the compression planned at ``--capacity``."""
    def planned(candidate) -> float:
        return harts.compile(candidate, capacity=args.capacity, chunk_size=args.chunk_size, verify=False).stats["compression"]

    if planned(batch) <= args.target_compression * 1.01:
        return batch
    return with_compression(batch, args.target_compression, vocab_size=config.vocab_size, seed=args.seed, measure=planned)


def build_workload(args, config: HybridConfig):
    """The SWE-like step, its selected trees and their compiled plan: (full step, batch, plan, steady-state
    planning seconds, the first compile's seconds)."""
    full = swe_like_step(seed=args.seed, scale=args.scale, vocab_size=config.vocab_size)
    if args.target_compression is None:
        batch = select_trees(full, args.tokens)
    else:
        batch = trees_near_compression(full, args.tokens, args.target_compression, args.capacity)
        batch = _lowered_to_compression(batch, args, config)
    say(f"workload: {len(batch.tokens)} trajectories of {len(set(np.asarray(batch.tree_ids).tolist()))} tree(s), "
        f"{batch.semantic_tokens} raw tokens (step had {len(full.tokens)} paths, {full.semantic_tokens} tokens)")
    say(f"compiling with capacity {args.capacity} ...")
    # A trainer plans every step; the process's first compile also pays one-time imports and
    # warm-up, which first_step_seconds counts. Core takes the median of the steady-state ones.
    seconds = []
    for _ in range(1 + max(0, args.plan_repeats)):
        plan_start = time.perf_counter()
        plan = harts.compile(batch, capacity=args.capacity, chunk_size=args.chunk_size, pipeline=args.pipeline)
        seconds.append(time.perf_counter() - plan_start)
    steady = float(np.median(seconds[1:])) if len(seconds) > 1 else seconds[0]
    say(f"planning: first compile {seconds[0]:.3f} s, steady state {steady:.3f} s (median of {len(seconds) - 1})")
    return full, batch, plan, steady, seconds[0]


def build_model(args, device: torch.device) -> HybridModel:
    config = build_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        model = HybridModel(config)
    return model


# ----------------------------------------------------------------------------- one training pass


def baseline_pass(model, batch, groups, chunk_size, kernels, num_trajectories, collect=False):
    """F/B/Grad of the trajectory-wise baseline; returns (loss, per-trajectory log-probs or None)."""
    losses = []
    collected = {}
    for group in groups:
        sub = batch.subset(group)
        out = log_probs_baseline(model, sub, recompute=True, chunk_size=chunk_size, kernels=kernels)
        loss = grpo_loss(out, sub, advantages=sub.trajectory_fields["advantage"], denominator=num_trajectories).loss
        loss.backward()
        losses.append(loss.detach())
        if collect:
            for j, trajectory in enumerate(group):
                collected[trajectory] = out.log_probs[j].detach().float().cpu()
    return total_of(losses), (collected if collect else None)


def total_of(losses: list[torch.Tensor]) -> float:
    """The pass's loss: its microbatches' losses read to the host in one go, after the last backward (a read
    per microbatch would make the host wait for the device there), and summed in float64 in their order."""
    return float(sum(torch.stack(losses).tolist())) if losses else 0.0


def harts_pass(model, plan, batch, kernels, num_trajectories, collect=False, view_type=TreeView):
    """F/B/Grad of the compiled plan, one microbatch at a time (``view_type``: the execution view, for ablations).

    ``plan``: a plan bound to ``batch`` (the benchmark binds once, :class:`_Run`), or a laid-out plan, bound
    here once per pass."""
    advantages = batch.trajectory_fields["advantage"]
    masks = batch.token_fields["loss_mask"]
    losses = []
    collected = {}
    bound = bind_plan(plan, batch, model)
    for microbatch in range(len(plan.module.microbatches)):
        out = microbatch_log_probs(model, bound, batch, microbatch, recompute=True, kernels=kernels, view_type=view_type)
        members = list(out.trajectories)
        pieces = [out.log_probs[int(out.offsets[j]) : int(out.offsets[j + 1])] for j in range(len(members))]
        loss = grpo_loss(
            pieces,
            advantages=advantages[members],
            loss_mask=[masks[t] for t in members],
            denominator=num_trajectories,
        ).loss
        loss.backward()
        losses.append(loss.detach())
        if collect:
            for j, trajectory in enumerate(members):
                collected[trajectory] = pieces[j].detach().float().cpu()
    return total_of(losses), (collected if collect else None)


def measure(name, run, model, device, warmup, repeats):
    """Warm up (the first warm-up pass also collects log-probs), then time ``repeats`` passes."""
    collected, loss = None, None
    for i in range(warmup):
        model.zero_grad(set_to_none=True)
        say(f"{name}: warm-up pass {i + 1}/{warmup}")
        loss, lp = run(collect=i == 0)
        collected = lp if i == 0 else collected
    times = []
    reset_peak_memory(device)
    for i in range(repeats):
        model.zero_grad(set_to_none=True)
        synchronize(device)
        start = time.perf_counter()
        loss, _ = run(collect=False)
        synchronize(device)
        times.append(time.perf_counter() - start)
        say(f"{name}: pass {i + 1}/{repeats} {times[-1]:.3f} s (loss {loss:.6e})")
    return {"seconds": times, "mean_seconds": float(np.mean(times)), "min_seconds": float(np.min(times)),
            "peak_memory_gib": peak_memory_gib(device), "loss": loss}, collected


# ----------------------------------------------------------------------------- ablation kernels


class SequenceAtATime(Dispatch):
    """The ablation's kernels: one linear-attention call per input sequence instead of one per round."""

    def chunk_linear_attention(self, q, k, v, log_decay, beta, cu_seqlens, *, chunk_size, scale,
                               initial_state=None, export_chunks=None):
        # the program's offsets carry their host copy: read there, as HARTS' own call reads them (no device read)
        bounds = host.read(cu_seqlens).tolist()
        sizes = np.diff(bounds).tolist()
        # one split per input: its backward is one concatenation, where a slice per sequence would
        # materialise a full-size zero gradient per sequence and charge that to the ablation
        pieces = [x.split(sizes) for x in (q, k, v, log_decay, beta)]
        states = None if initial_state is None else initial_state.split(1)
        outputs, finals, exports = [], [], []
        for i, size in enumerate(sizes):
            # on the host, as NodeAtATimeView's: the kernels read offsets on the host and keep their own device copy
            one = torch.tensor([0, size], dtype=cu_seqlens.dtype)
            o, final, exported = super().chunk_linear_attention(
                *(piece[i] for piece in pieces), one,
                chunk_size=chunk_size, scale=scale,
                initial_state=None if states is None else states[i],
                export_chunks=None if export_chunks is None else [export_chunks[i]],
            )
            outputs.append(o)
            finals.append(final)
            exports.append(exported)
        return torch.cat(outputs), torch.cat(finals), torch.cat(exports)


class StockFla(Dispatch):
    """The kernels of the baseline a user runs today: linear attention on stock fla ``chunk_kda``."""

    def chunk_linear_attention(self, q, k, v, log_decay, beta, cu_seqlens, *, chunk_size, scale,
                               initial_state=None, export_chunks=None):
        if not self.uses_fast_linear_attention(q, k, v, chunk_size):
            return super().chunk_linear_attention(q, k, v, log_decay, beta, cu_seqlens, chunk_size=chunk_size,
                                                  scale=scale, initial_state=initial_state, export_chunks=export_chunks)
        return fla_chunk.stock_chunk_kda(q, k, v, log_decay, beta, cu_seqlens, chunk_size=chunk_size, scale=scale,
                                         initial_state=initial_state, export_chunks=export_chunks)


# ----------------------------------------------------------------------------- fidelity


@torch.no_grad()
def hidden_by_trajectory_baseline(model, batch, groups, chunk_size, kernels, forks=None):
    """Final hidden states per trajectory, each trajectory expanded; with ``forks`` (one list of fork
    positions per trajectory) every fork restarts the linear-attention chunk grid (the §5.4 no-replay ablation)."""
    hidden = {}
    device = model.device
    for group in groups:
        lengths = [len(batch.tokens[i]) for i in group]
        if forks is None:
            view = BaselineView(lengths, chunk_size, device, kernels=kernels)
        else:
            view = NoReplayView(lengths, [forks[i] for i in group], chunk_size, device, kernels=kernels)
        ids = torch.as_tensor(np.concatenate([batch.tokens[i] for i in group]), dtype=torch.long, device=device)
        states, _ = model.forward_hidden(ids, view)
        for trajectory, piece in zip(group, states.split(lengths)):
            hidden[trajectory] = piece
    return hidden


@torch.no_grad()
def hidden_by_trajectory_harts(model, plan, batch, kernels):
    hidden = {}
    for microbatch in range(len(plan.module.microbatches)):
        layout = plan.layout(microbatch)
        view = TreeView(layout, device=model.device, kernels=kernels)
        states, _ = model.forward_hidden(view.input_ids(batch.tokens), view)
        for j, trajectory in enumerate(layout.trajectories):
            rows = layout.trajectory_rows[layout.trajectory_offsets[j] : layout.trajectory_offsets[j + 1]]
            hidden[int(trajectory)] = states.index_select(0, torch.tensor(rows, device=states.device))
    return hidden


@torch.no_grad()
def logit_agreement(model, reference, other, batch, block_rows):
    """Mean token-wise cosine of full-vocabulary logits, mean |delta NLL| of the next token."""
    cosine_sum, nll_sum, count = 0.0, 0.0, 0
    for trajectory, ref_hidden in reference.items():
        tokens = torch.tensor(batch.tokens[trajectory], device=ref_hidden.device)  # a copy: batch token arrays are read-only
        other_hidden = other[trajectory]
        for start in range(0, ref_hidden.shape[0] - 1, block_rows):
            stop = min(ref_hidden.shape[0] - 1, start + block_rows)
            a = model.logits(ref_hidden[start:stop]).double()
            b = model.logits(other_hidden[start:stop]).double()
            cosine_sum += float(torch.nn.functional.cosine_similarity(a, b, dim=-1).sum())
            targets = tokens[start + 1 : stop + 1]
            nll_a = torch.logsumexp(a, -1) - a.gather(1, targets[:, None])[:, 0]
            nll_b = torch.logsumexp(b, -1) - b.gather(1, targets[:, None])[:, 0]
            nll_sum += float((nll_a - nll_b).abs().sum())
            count += stop - start
    return cosine_sum / max(count, 1), nll_sum / max(count, 1)


def gradient_agreement(saved, model) -> float:
    """Cosine between the flattened parameter gradients of two passes."""
    dot = norm_a = norm_b = 0.0
    for reference, parameter in zip(saved, model.parameters()):
        if reference is None or parameter.grad is None:
            continue
        a, b = reference.to(parameter.grad.device).double(), parameter.grad.double()
        dot += float((a * b).sum())
        norm_a += float((a * a).sum())
        norm_b += float((b * b).sum())
    return dot / math.sqrt(max(norm_a * norm_b, 1e-300))


def profile_pass(name, run, model):
    """Profile one pass: print the top operators; return the profiler (for the per-family and
    per-kernel tables) and the pass's wall seconds under it, which exceed the kernels' sum by the
    time the device sat idle."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    model.zero_grad(set_to_none=True)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        run()
        synchronize(model.device)
        wall = time.perf_counter() - started
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    say(f"profile of one {name} pass ({wall:.3f} s under the profiler):\n"
        + prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
    model.zero_grad(set_to_none=True)
    return prof, wall


# ----------------------------------------------------------------------------- kernel micro-benchmark


def _time_ms(fn, device, repeats=5):
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeats * 1e3


def _plan_round_calls(plan):
    """(cu_seqlens, export_chunks) of every linear-attention round of the benchmark's plan."""
    from harts.codegen.fx import round_schedule

    calls = []
    for microbatch in range(len(plan.module.microbatches)):
        layout = plan.layout(microbatch)
        for r in range(layout.num_rounds):
            schedule = round_schedule(layout, r)
            calls.append((schedule["cu_seqlens"], schedule["export_chunks"]))
    return calls


def kernel_bench(args, device) -> dict:
    """Forward and forward+backward of linear attention: stock fla vs HARTS' call, KDA and GDN.

    ``packed``: --kernel-tokens rows in varlen sequences with initial states, no exports (HARTS'
    call against stock ``chunk_kda`` on the same input). ``plan_rounds``: every round of the
    benchmark plan's microbatches at the model's shape, with the round's real initial states and
    exports (HARTS) against the same packed rows through stock fla without exports.
    """
    config = build_config(args)
    heads, key_dim, value_dim = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    chunk = args.chunk_size
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.kernel_tokens // 16, args.kernel_tokens // 4, size=64)
    lengths = lengths[: max(1, int(np.searchsorted(np.cumsum(lengths), args.kernel_tokens)))]
    packed_bounds = np.concatenate([[0], np.cumsum(lengths)])
    _full, batch, plan, _seconds, _first = build_workload(args, config)
    rounds = _plan_round_calls(plan)
    results = {"tokens": int(packed_bounds[-1]), "sequences": len(lengths), "heads": heads, "key_dim": key_dim,
               "value_dim": value_dim, "chunk_size": chunk, "plan_rounds": len(rounds),
               "plan_round_rows": [int(b[-1]) for b, _ in rounds]}
    kernels = {"stock_fla": fla_chunk.stock_chunk_kda, "harts": fla_chunk.chunk_linear_attention}

    def inputs_for(total, sequences, gate, dtype):
        torch.manual_seed(0)
        q = torch.nn.functional.normalize(torch.randn(total, heads, key_dim, device=device), dim=-1).to(dtype)
        k = torch.nn.functional.normalize(torch.randn(total, heads, key_dim, device=device), dim=-1).to(dtype)
        v = torch.randn(total, heads, value_dim, device=device).to(dtype)
        shape = (total, heads, key_dim) if gate == "kda" else (total, heads)
        log_decay = -torch.rand(shape, device=device) * 0.2
        beta = torch.rand(total, heads, device=device).to(dtype)
        initial = torch.randn(sequences, heads, key_dim, value_dim, device=device) * 0.1
        return [t.requires_grad_() for t in (q, k, v, log_decay, beta, initial)]

    def time_calls(kernel, calls, with_exports):
        say(f"kernel bench: {len(calls)} call(s), exports {'on' if with_exports else 'off'}, {kernel.__name__}")

        def forward():
            with torch.no_grad():
                for inputs, cu, exports in calls:
                    kernel(*inputs[:5], cu, chunk_size=chunk, scale=key_dim**-0.5, initial_state=inputs[5],
                           export_chunks=exports if with_exports else None)

        def forward_backward():
            for inputs, cu, exports in calls:
                o, final, exported = kernel(*inputs[:5], cu, chunk_size=chunk, scale=key_dim**-0.5,
                                            initial_state=inputs[5], export_chunks=exports if with_exports else None)
                (o.float().sum() + final.sum() + exported.sum()).backward()

        return {"forward_ms": _time_ms(forward, device), "forward_backward_ms": _time_ms(forward_backward, device)}

    dtype = getattr(torch, config.dtype) if device.type == "cuda" else torch.float32
    for gate in ("kda", "gdn"):
        packed = [(inputs_for(int(packed_bounds[-1]), len(lengths), gate, dtype),
                   torch.as_tensor(packed_bounds, device=device), None)]
        plan_calls = [(inputs_for(int(b[-1]), len(b) - 1, gate, dtype), torch.as_tensor(b, device=device), exports)
                      for b, exports in rounds]
        for name, kernel in kernels.items():
            entry = {"packed": time_calls(kernel, packed, False),
                     "plan_rounds": time_calls(kernel, plan_calls, name == "harts")}
            results[f"{gate}_{name}"] = entry
            say(f"kernel bench {gate} {name}: {entry}")
        if gate == "gdn" and device.type == "cuda":
            inputs, cu = packed[0][0], packed[0][1]

            def gdn_forward():
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule

                with torch.no_grad():
                    chunk_gated_delta_rule(*(t.unsqueeze(0) for t in inputs[:5]), scale=key_dim**-0.5,
                                           initial_state=inputs[5], output_final_state=True, cu_seqlens=cu)

            try:
                results["gdn_stock_gated_delta_rule_forward_ms"] = _time_ms(gdn_forward, device)
                say(f"kernel bench gdn stock chunk_gated_delta_rule forward: "
                    f"{results['gdn_stock_gated_delta_rule_forward_ms']:.3f} ms")
            except Exception as error:  # fla's GDN kernels refuse some Triton / GPU pairs
                results["gdn_stock_gated_delta_rule_error"] = repr(error)[:300]
    for gate in ("kda", "gdn"):
        stock, ours = results[f"{gate}_stock_fla"], results[f"{gate}_harts"]
        for case in ("packed", "plan_rounds"):
            ratio = ours[case]["forward_backward_ms"] / stock[case]["forward_backward_ms"]
            results[f"{gate}_{case}_ratio_vs_stock"] = ratio
        print(f"kernel-fla: gate={gate} packed_fwd_bwd_ratio={results[f'{gate}_packed_ratio_vs_stock']:.3f} "
              f"plan_rounds_fwd_bwd_ratio={results[f'{gate}_plan_rounds_ratio_vs_stock']:.3f}", flush=True)
    results["conv"] = conv_bench(args, config, plan, batch, device, dtype)
    return results


def conv_bench(args, config, plan, batch, device, dtype) -> dict:
    """Causal convolution forward and forward+backward: the gather + einsum reference against
    fla's ``causal_conv1d`` (context as its initial state), on the plan's conv programs (true-
    ancestor context gathered per sequence) and on the baseline's trajectory-wise packed calls."""
    from types import SimpleNamespace

    from harts.codegen.fx import build_conv_program
    from harts.kernels.conv import fla as fla_conv
    from harts.kernels.conv import naive as naive_conv

    channels = config.linear_conv_channels
    width = config.linear_conv_kernel_dim
    variants = {"reference": naive_conv.causal_conv1d}
    if device.type == "cuda" and fla_conv.fla_conv_available(torch.zeros(1, 1, device=device, dtype=dtype),
                                                           torch.zeros(1, width, device=device)):
        variants["fla"] = fla_conv.causal_conv1d
    generator = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(channels, width, generator=generator, device=device) / width).to(dtype).requires_grad_()
    harts_rows = [plan.layout(m) for m in range(len(plan.module.microbatches))]
    groups = baseline_microbatches(batch.lengths, args.capacity)
    baseline_bounds = [np.concatenate([[0], np.cumsum([batch.lengths[i] for i in group])]) for group in groups]
    results = {"channels": channels, "width": width, "harts_calls": len(harts_rows), "baseline_calls": len(groups)}
    for name, kernel in variants.items():
        namespace = SimpleNamespace(causal_conv1d=kernel)
        programs = [(build_conv_program(layout, width, kernels=namespace).to(device), layout.num_rows)
                    for layout in harts_rows]
        calls = {
            "harts": [(program, torch.randn(rows, channels, generator=generator, device=device).to(dtype))
                      for program, rows in programs],
            "baseline": [(functools.partial(kernel, cu_seqlens=torch.as_tensor(b, device=device)),
                          torch.randn(int(b[-1]), channels, generator=generator, device=device).to(dtype))
                         for b in baseline_bounds],
        }
        for case, case_calls in calls.items():
            inputs = [(call, x.requires_grad_()) for call, x in case_calls]

            def forward():
                with torch.no_grad():
                    for call, x in inputs:
                        call(x, weight, None, activation="silu")

            def forward_backward():
                for call, x in inputs:
                    call(x, weight, None, activation="silu").float().square().sum().backward()

            entry = {"forward_ms": _time_ms(forward, device), "forward_backward_ms": _time_ms(forward_backward, device)}
            results[f"{case}_{name}"] = entry
            say(f"conv bench {case} {name}: {entry}")
    if "fla" in variants:
        for case in ("harts", "baseline"):
            ratio = results[f"{case}_fla"]["forward_backward_ms"] / results[f"{case}_reference"]["forward_backward_ms"]
            results[f"{case}_fla_vs_reference"] = ratio
        print(f"kernel-conv: harts_fla_vs_reference={results['harts_fla_vs_reference']:.3f} "
              f"baseline_fla_vs_reference={results['baseline_fla_vs_reference']:.3f}", flush=True)
    return results


# ----------------------------------------------------------------------------- attention head-to-head


def attention_bench_main(args, device: torch.device) -> dict:
    """``--attention-bench``: the workload and plan of the main benchmark, full attention only."""
    config = build_config(args)
    _full, batch, plan, plan_seconds, _first = build_workload(args, config)
    say(f"plan: {plan_seconds:.2f} s, {len(plan.module.microbatches)} microbatch(es), compression {plan.stats.get('compression', float('nan')):.3f}")
    results = {
        "config": dict(vars(args)),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "model": {"preset": args.preset, "attention": config.attention, "dtype": config.dtype},
        "workload": {"trajectories": len(batch.tokens), "raw_tokens": int(batch.semantic_tokens)},
        "plan": {"seconds": plan_seconds, "microbatches": len(plan.module.microbatches), "stats": plan.stats},
        **run_attention_bench(args, device, config, plan),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(format_table(results), flush=True)
    say(f"wrote {out}")
    return results


# ----------------------------------------------------------------------------- main


def first_training_step(model, plan, batch, kernels, device) -> None:
    """One HARTS training step: F/B/Grad over the plan's microbatches and one AdamW update."""
    model.zero_grad(set_to_none=True)
    harts_pass(model, plan, batch, kernels, len(batch.tokens))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.grad is not None], lr=1e-6, foreach=False)
    optimizer.step()
    synchronize(device)
    model.zero_grad(set_to_none=True)
    del optimizer


def write_results(path, results: dict) -> None:
    """Write the results so far (atomically: a run cut short keeps its last complete file)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(results, indent=2, default=str))
    partial.replace(out)
    say(f"wrote {out}")


def main(argv=None) -> dict:
    """The benchmark's entry point: one of its three subcommands, by flag (see the module docstring)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.dtype is None:
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.matmul_precision is None:
        args.matmul_precision = "high" if device.type == "cuda" else "highest"
    # The log-prob head runs its [rows, vocab] GEMMs in fp32 (exact normalisers); with "highest"
    # they take half of an F/B/Grad pass on an H200. TF32 ("high") is closer to what bf16
    # training stacks do and applies to the baseline and HARTS alike.
    torch.set_float32_matmul_precision(args.matmul_precision)
    if args.kernel_bench:
        if not fla_chunk.fla_available():
            # the kernel bench times stock fla against HARTS' call: without fla (and a GPU) there is nothing to time
            raise harts.HartsError("--kernel-bench times flash-linear-attention's kernels: install fla and run on a CUDA GPU")
        results = kernel_bench(args, device)
        Path(args.out).write_text(json.dumps(results, indent=2))
        return results
    if args.attention_bench:
        return attention_bench_main(args, device)
    if args.tp is not None or args.ep is not None:
        from harts_bench.megatron import megatron_bench

        return megatron_bench(args, device)
    return runtime_bench(args, device)


@attrs.define
class _Run:
    """What every stage of the runtime benchmark works on: its model, workload, plan and kernel sets."""

    args: argparse.Namespace
    device: torch.device
    kernels: Dispatch
    stock: "StockFla"
    model: HybridModel
    batch: Any
    plan: Any
    groups: list[list[int]]
    #: the plan bound to the batch and checked against the model, once (as Trainer.step binds once per step):
    #: the passes then run on it without binding work, and its microbatches' rows go to the device once
    bound: Any
    results: dict = attrs.field(factory=dict)

    @property
    def num_trajectories(self) -> int:
        return len(self.batch.tokens)


def runtime_bench(args, device: torch.device) -> dict:
    """The headline benchmark: HARTS against the trajectory-wise baseline, then ablations, fidelity, diagnostics."""
    run = _set_up(args, device)
    baseline_lp, harts_lp = _measure_passes(run)
    if not args.no_ablation:
        _measure_ablations(run, baseline_lp)
    run.model.zero_grad(set_to_none=True)
    if not args.no_fidelity:
        _measure_fidelity(run)
    _speedups(run.results)
    # written and printed before the optional diagnostics, so a run cut short in them keeps its figures
    write_results(args.out, run.results)
    _print_headline(run.results)
    if args.train_step:
        _time_train_steps(run)
    if args.sync_debug and device.type == "cuda":
        _count_syncs(run)
    if args.profile:
        _profile(run)
        if "train_step" in run.results:
            print(headline_train_line(run.results), flush=True)
    return run.results


def _set_up(args, device: torch.device) -> _Run:
    """Model, workload, plan, the first training step and the run's static figures."""
    kernels, stock = Dispatch(args.kernels), StockFla(args.kernels)
    fla_ready = device.type == "cuda" and fla_chunk.fla_available()
    say(f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", kernels={args.kernels}, fla={'yes' if fla_ready else 'no (the stock-fla baseline runs the reference)'}, "
        f"fp32 matmul precision={args.matmul_precision}")
    model = build_model(args, device)
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    say(f"model {args.preset}: {config.num_layers} layers {list(config.layer_types)}, {params / 1e6:.1f}M parameters, "
        f"{config.dtype}, chunk {args.chunk_size}")
    _full, batch, plan, plan_seconds, first_plan_seconds = build_workload(args, config)
    say("first training step (HARTS: F/B/Grad over the plan + one optimizer step) ...")
    first_training_step(model, plan, batch, kernels, device)
    first_step_seconds = time.perf_counter() - STARTED
    say(f"first training step finished {first_step_seconds:.1f} s after start")
    groups = baseline_microbatches(batch.lengths, args.capacity)
    say(f"baseline: {len(groups)} microbatch(es) of <= {args.capacity} raw tokens")
    started = time.perf_counter()
    bound = bind_plan(plan, batch, model)
    bind_seconds = time.perf_counter() - started
    run = _Run(args, device, kernels, stock, model, batch, plan, groups, bound)
    run.results = {
        "config": {k: v for k, v in vars(args).items()},
        "model": {"preset": args.preset, "layers": config.num_layers, "layer_types": list(config.layer_types),
                  "parameters": params, "dtype": config.dtype, "chunk_size": args.chunk_size},
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "fla": fla_ready,
        "first_step_seconds": first_step_seconds,
        "workload": {"trajectories": run.num_trajectories, "raw_tokens": int(batch.semantic_tokens),
                     "trees": len(set(np.asarray(batch.tree_ids).tolist()))},
        **_plan_figures(run, plan_seconds, first_plan_seconds, bind_seconds),
        "baseline_microbatches": len(groups),
    }
    return run


def _plan_figures(run: _Run, plan_seconds: float, first_plan_seconds: float, bind_seconds: float) -> dict:
    """The plan's shape: rows, rounds, sequences and trie nodes per microbatch, compression, calls per layer."""
    plan, batch = run.plan, run.batch
    stats = plan.stats
    layouts = list(plan.layouts)
    compact_rows = sum(layout.num_rows for layout in layouts)
    rounds = [layout.num_rounds for layout in layouts]
    # serial chunk steps of the state scans: per round its longest sequence, summed (round_critical_path)
    round_steps = [list(round_critical_path(layout)) for layout in layouts]
    longest_chunks = [int(-(-int(batch.lengths[layout.trajectories].max()) // plan.chunk_size)) for layout in layouts]
    sequences = [layout.num_sequences for layout in layouts]
    trie_nodes = [TrieNodes.from_layout(layout) for layout in layouts]
    nodes = [n.num_nodes for n in trie_nodes]
    # node starts past position 0 that are not multiples of B: where node-at-a-time's chunk grid shifts
    off_grid = [int(np.count_nonzero(n.position % plan.chunk_size)) for n in trie_nodes]
    # full attention shares less than rows do: every branch's queries still see its whole prefix
    pair_compression = causal_attention_pairs(batch.lengths) / plan_attention_pairs(layouts)
    say(f"plan: {plan_seconds:.2f} s, {len(layouts)} microbatch(es), {compact_rows} compact rows, "
        f"compression {batch.semantic_tokens / compact_rows:.3f} (attention query-key pairs {pair_compression:.3f}), "
        f"rounds {rounds}, replay {stats.get('replay_tokens')}, trie nodes {nodes} ({off_grid} off the chunk grid), "
        f"state-scan chunk steps per round {round_steps} (sum {[sum(steps) for steps in round_steps]}, "
        f"longest trajectory {longest_chunks})")
    return {
        "plan": {"seconds": plan_seconds, "first_compile_seconds": first_plan_seconds, "bind_seconds": bind_seconds,
                 "pipeline": plan.pipeline, "microbatches": len(layouts), "compact_rows": compact_rows,
                 "replay_tokens": stats.get("replay_tokens"), "rounds_per_microbatch": rounds,
                 "sequences_per_microbatch": sequences, "trie_nodes_per_microbatch": nodes,
                 "round_chunk_steps_per_microbatch": round_steps,
                 "critical_path_chunks_per_microbatch": [sum(steps) for steps in round_steps],
                 "longest_trajectory_chunks_per_microbatch": longest_chunks,
                 "trie_nodes_off_chunk_grid": off_grid, "stats": stats},
        "compression": batch.semantic_tokens / compact_rows,
        "attention_pair_compression": pair_compression,
        "linear_attention_calls_per_microbatch": {
            "baseline": 1,
            "harts": float(np.mean(rounds)),
            "harts_max": int(max(rounds)),
            "sequence_at_a_time": float(np.mean(sequences)),
            "node_at_a_time": float(np.mean(nodes)),
            "node_at_a_time_max": int(max(nodes)),
            "note": "per linear-attention layer; harts = rounds, sequence_at_a_time = input sequences, "
                    "node_at_a_time = trie nodes (maximal fork-free runs) of the microbatch",
        },
    }


def _measure_passes(run: _Run):
    """F/B/Grad of the stock-fla baseline, the baseline on HARTS' kernels and HARTS; their log-probs."""
    args, model, results, chunk_size = run.args, run.model, run.results, run.args.chunk_size
    baseline_fla, baseline_lp = measure(
        "baseline (stock fla)",
        lambda collect: baseline_pass(model, run.batch, run.groups, chunk_size, run.stock, run.num_trajectories, collect),
        model, run.device, args.warmup, args.repeats)
    # kept on the host so that the HARTS peak-memory figure does not carry a second set of gradients
    baseline_grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    results["baseline_fla"] = baseline_fla
    if not args.no_own_baseline:
        own, _ = measure(
            "baseline (HARTS kernels)",
            lambda collect: baseline_pass(model, run.batch, run.groups, chunk_size, run.kernels, run.num_trajectories, False),
            model, run.device, args.warmup, args.repeats)
        results["baseline"] = own
        model.zero_grad(set_to_none=True)
    harts_result, harts_lp = measure(
        "harts", lambda collect: harts_pass(model, run.bound, run.batch, run.kernels, run.num_trajectories, collect),
        model, run.device, args.warmup, args.repeats)
    results["harts"] = harts_result
    results["gradient_cosine"] = gradient_agreement(baseline_grads, model)
    # the A/Bs: the HARTS pass on another execution view of the same plan, in this process
    # (flag, execution view, context the passes run in, label)
    variants = (("packed_linear_rows", PackedLinearRowsView, contextlib.nullcontext, "linear attention on packed rows"),
                ("cascade_attention", CascadeAttentionView, contextlib.nullcontext, "attention split at the forks"),
                ("keep_linear_intermediates", TreeView, fla_chunk.intermediates_kept_in_recompute,
                 "linear-attention intermediates kept from the recompute"))
    for name, view_type, context, label in variants:
        if not getattr(args, name):
            continue
        with context():
            variant, _ = measure(
                f"harts, {label}",
                lambda collect, view_type=view_type: harts_pass(model, run.bound, run.batch, run.kernels,
                                                                run.num_trajectories, False, view_type=view_type),
                model, run.device, args.warmup, args.repeats)
        results[f"harts_{name}"] = variant
        say(f"{label}: {variant['mean_seconds']:.3f} s a pass against {harts_result['mean_seconds']:.3f} s "
            f"({variant['mean_seconds'] / harts_result['mean_seconds']:.3f}x)")
    del baseline_grads
    plan_seconds, bind_seconds = results["plan"]["seconds"], results["plan"]["bind_seconds"]
    # the passes run on the plan bound once: the binding is charged to the core figure with the plan
    results["core"] = {"mean_seconds": plan_seconds + bind_seconds + harts_result["mean_seconds"],
                       "plan_seconds": plan_seconds, "bind_seconds": bind_seconds}
    if baseline_lp is not None and harts_lp is not None:
        deltas = [float((baseline_lp[t] - harts_lp[t]).abs().mean()) for t in baseline_lp]
        results["mean_abs_logprob_delta"] = float(np.mean(deltas))
    results["loss_delta"] = abs(baseline_fla["loss"] - harts_result["loss"])
    return baseline_lp, harts_lp


def _measure_ablations(run: _Run, baseline_lp) -> None:
    """Sequence-at-a-time and node-at-a-time on the same plan and rows."""
    args, model = run.args, run.model
    ablation, _ = measure(
        "sequence-at-a-time",
        lambda collect: harts_pass(model, run.bound, run.batch, SequenceAtATime(args.kernels), run.num_trajectories, False),
        model, run.device, min(args.warmup, 1), max(1, min(args.repeats, 1)))
    run.results["sequence_at_a_time"] = ablation
    node_result, node_lp = measure(
        "node-at-a-time",
        lambda collect: harts_pass(model, run.bound, run.batch, run.kernels, run.num_trajectories, collect,
                                   view_type=NodeAtATimeView),
        model, run.device, min(args.warmup, 1), max(1, min(args.repeats, 1)))
    run.results["node_at_a_time"] = node_result
    if baseline_lp is not None and node_lp is not None:
        deltas = [float((baseline_lp[t] - node_lp[t]).abs().mean()) for t in baseline_lp]
        run.results["node_at_a_time_mean_abs_logprob_delta"] = float(np.mean(deltas))


def _measure_fidelity(run: _Run) -> None:
    """Logit cosine and |dNLL| of HARTS, a rerun and a repacked baseline against the stock-fla baseline."""
    args, model, batch, chunk_size = run.args, run.model, run.batch, run.args.chunk_size
    say("fidelity: hidden states of the stock-fla baseline, its rerun, repacked, and HARTS ...")
    reference = hidden_by_trajectory_baseline(model, batch, run.groups, chunk_size, run.stock)
    rerun = hidden_by_trajectory_baseline(model, batch, run.groups, chunk_size, run.stock)
    # same math, other packing (each trajectory alone): the rounding noise of a different
    # but equally valid execution, a noise floor that a deterministic rerun cannot show
    repacked = hidden_by_trajectory_baseline(model, batch, [[i] for i in range(run.num_trajectories)], chunk_size, run.stock)
    compact = hidden_by_trajectory_harts(model, run.plan, batch, run.kernels)
    cosine, nll = logit_agreement(model, reference, compact, batch, args.fidelity_rows)
    rerun_cosine, rerun_nll = logit_agreement(model, reference, rerun, batch, args.fidelity_rows)
    repack_cosine, repack_nll = logit_agreement(model, reference, repacked, batch, args.fidelity_rows)
    run.results["fidelity"] = {"cosine": cosine, "rerun_cosine": rerun_cosine, "repack_cosine": repack_cosine,
                               "mean_abs_delta_nll": nll, "rerun_mean_abs_delta_nll": rerun_nll,
                               "repack_mean_abs_delta_nll": repack_nll}
    say(f"fidelity: cosine {cosine:.8f} (rerun {rerun_cosine:.8f}, repacked baseline {repack_cosine:.8f}), "
        f"|dNLL| {nll:.3e} (rerun {rerun_nll:.3e}, repacked {repack_nll:.3e})")
    if not args.no_replay_ablation:
        _replay_ablation(run, {"rerun": rerun, "repacked": repacked, "replay": compact}, reference)


def _replay_ablation(run: _Run, hidden: dict, reference) -> None:
    """Divergence from the baseline by state-handoff depth, with replay (HARTS) and without (Eq. 25-26)."""
    say("replay ablation: no-replay hidden states and divergence by state-handoff depth ...")
    batch, model = run.batch, run.model
    forks = fork_positions(run.plan.module.trie)
    depths = {i: handoff_depths(forks[i], len(batch.tokens[i])) for i in range(run.num_trajectories)}
    hidden = dict(hidden, no_replay=hidden_by_trajectory_baseline(model, batch, run.groups, run.args.chunk_size,
                                                                  run.kernels, forks))
    table = {name: divergence_by_depth(model, reference, other, batch.tokens, depths, block_rows=run.args.fidelity_rows)
             for name, other in hidden.items()}
    run.results["replay_ablation"] = table
    for d in range(6):
        row = table["replay"][d]
        say(f"  depth {d} ({row['tokens']} tokens): SymKL rerun {table['rerun'][d]['symkl']:.3e} "
            f"replay {row['symkl']:.3e} no-replay {table['no_replay'][d]['symkl']:.3e}; |dNLL| rerun "
            f"{table['rerun'][d]['mean_abs_delta_nll']:.3e} replay {row['mean_abs_delta_nll']:.3e} "
            f"no-replay {table['no_replay'][d]['mean_abs_delta_nll']:.3e}")


def _speedups(results: dict) -> None:
    reference_seconds = results["baseline_fla"]["mean_seconds"]
    harts_seconds = results["harts"]["mean_seconds"]
    results["speedup_vs_fla_baseline"] = reference_seconds / harts_seconds
    results["core_vs_fla_baseline"] = reference_seconds / results["core"]["mean_seconds"]
    if "baseline" in results:
        results["speedup_vs_own_baseline"] = results["baseline"]["mean_seconds"] / harts_seconds
        results["own_baseline_vs_fla_baseline"] = results["baseline"]["mean_seconds"] / reference_seconds
    if "sequence_at_a_time" in results:
        results["sequence_at_a_time_speedup"] = reference_seconds / results["sequence_at_a_time"]["mean_seconds"]
    if "node_at_a_time" in results:
        results["node_at_a_time_speedup"] = reference_seconds / results["node_at_a_time"]["mean_seconds"]
        results["harts_vs_node_at_a_time_speedup"] = results["node_at_a_time"]["mean_seconds"] / harts_seconds


def _print_headline(results: dict) -> None:
    fidelity = results.get("fidelity", {})
    print(
        f"headline-fla: compression={results['compression']:.4f} "
        f"speedup_vs_fla_baseline={results['speedup_vs_fla_baseline']:.4f} "
        f"core_vs_fla_baseline={results['core_vs_fla_baseline']:.4f} "
        f"speedup_vs_own_baseline={results.get('speedup_vs_own_baseline', float('nan')):.4f} "
        f"cosine={fidelity.get('cosine', float('nan')):.8f} first_step_seconds={results['first_step_seconds']:.1f}",
        flush=True,
    )


def _time_train_steps(run: _Run) -> None:
    """``--train-step``: ``Trainer.step`` in both modes on this run's model, plan and batch."""
    say("the training step (harts.train.Trainer.step, as `harts train` runs it) in both modes ...")
    run.results["train_step"] = train_step_figures(run.model, run.plan, run.batch, kernels=run.kernels,
                                                   baseline_kernels=run.stock, warmup=run.args.warmup,
                                                   repeats=run.args.repeats, say=say,
                                                   optimizer=run.args.train_step_optimizer)
    write_results(run.args.out, run.results)
    print(headline_train_line(run.results), flush=True)


def _count_syncs(run: _Run) -> None:
    """``--sync-debug``: one HARTS pass's host-device synchronisations by source line."""
    with SyncSites() as syncs:
        harts_pass(run.model, run.bound, run.batch, run.kernels, run.num_trajectories)
        synchronize(run.device)
    run.model.zero_grad(set_to_none=True)
    run.results["harts_sync_sites"] = syncs.table()
    say(f"harts: {sum(syncs.sites.values())} host-device synchronisations in one pass:\n"
        + "\n".join(f"  {row['count']:>6}  {row['site']}" for row in run.results["harts_sync_sites"][:20]))
    write_results(run.args.out, run.results)


def _profile(run: _Run) -> None:
    """``--profile``: torch.profiler tables of a baseline and a HARTS pass, by operator family and kernel."""
    args, model, results, device = run.args, run.model, run.results, run.device
    run_baseline = lambda: baseline_pass(model, run.batch, run.groups, args.chunk_size, run.stock, run.num_trajectories)  # noqa: E731
    run_harts = lambda: harts_pass(model, run.bound, run.batch, run.kernels, run.num_trajectories)  # noqa: E731
    passes = (("baseline", run_baseline), ("harts", run_harts)) if args.profile == "both" else (("harts", run_harts),)
    by_family, results["profile_kernels"] = {}, {}
    for name, one_pass in passes:
        profiler, wall = profile_pass(name, one_pass, model)
        by_family[name] = seconds_by_family(profiler, device.type)
        kernels_table = seconds_by_kernel(profiler, device.type)
        busy = sum(row["seconds"] for row in kernels_table)
        gaps = idle_gaps(kernel_intervals(profiler)) if device.type == "cuda" else None
        waits = gaps_before_kernels(kernel_events(profiler)) if device.type == "cuda" else None
        results["profile_kernels"][name] = {"wall_seconds": wall, "busy_seconds": busy, "kernels": kernels_table,
                                            "device_gaps": gaps, "gaps_before_kernels": waits}
        say(f"{name}: {wall:.3f} s wall under the profiler, {busy:.3f} s of kernels ({wall - busy:+.3f} s idle or overlapped)")
        if gaps is not None:
            say(f"{name}: device idle {gaps['idle_us'] * 1e-6:.3f} s between its first and last kernel: "
                + ", ".join(f"{label} {row['idle_us'] * 1e-6:.3f} s in {row['gaps']} gaps"
                            for label, row in gaps["by_gap"].items()))
            say(f"{name}: the launches the device waited longest for (idle gaps >= 10 us, by the kernels around them):\n"
                + "\n".join(f"  {row['idle_us'] * 1e-3:8.2f} ms in {row['gaps']:>5} gaps (largest {row['largest_us'] * 1e-3:.2f} ms)"
                             f"  {row['before'][:60]}  ->  {row['after'][:60]}" for row in waits))
        del profiler
        write_results(args.out, results)
    if "baseline" in by_family:
        results["profile_by_family"] = excess_over_compression(
            by_family["baseline"], by_family["harts"], results["compression"],
            {"full attention": results["attention_pair_compression"]})
        say("where HARTS spends more than baseline / compression (self time by operator family, one pass each):\n"
            + format_excess(results["profile_by_family"]))
        results["refined_limit"] = refined_limit(results["profile_by_family"])
        results["fraction_of_refined_limit"] = results["speedup_vs_fla_baseline"] / results["refined_limit"]
        say(f"refined limit (each family at its own compression): {results['refined_limit']:.3f}x; "
            f"the headline's {results['speedup_vs_fla_baseline']:.3f}x is {results['fraction_of_refined_limit']:.3f} of it")
        write_results(args.out, results)


def console_main() -> None:
    """The ``harts-bench`` console script: :func:`main` on the command line's arguments, failures reported as the
    ``harts`` CLI reports them (one ``error:`` line, exit 2 for bad input or options, 3 for a bug)."""
    from harts.cli import reports_errors

    app = typer.Typer(add_completion=False)

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
    @reports_errors
    def bench(ctx: typer.Context) -> None:
        main(ctx.args)

    app()


if __name__ == "__main__":
    console_main()
