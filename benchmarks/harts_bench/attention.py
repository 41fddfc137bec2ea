"""Attention head-to-head on the microbatch layouts of a compiled plan (``harts bench --attention-bench``).

Full attention of a compiled microbatch can be executed two ways; this times both on every
microbatch layout of the plan ``harts bench`` builds (same ``--tokens``, ``--capacity``,
``--seed``, ``--scale``; head counts and head dims of the preset's full-attention layer;
the model dtype, bf16 on CUDA), on random queries, keys and values:

* ``gathered_varlen``: the runtime's path, called exactly as
  :class:`~harts.runtime.tree_view.TreeView` calls it (``TreeView.attention`` with
  ``harts.kernels.dispatch``): every input sequence's ancestor + own keys/values gathered into
  one packed buffer (``index_select``: a branch reads a private copy of its shared prefix and
  backward sums the copies' gradients back), then varlen FlashAttention with bottom-right
  causal alignment (the reference kernel on CPU);
* ``flex_tree``: :func:`harts.kernels.attention.tree_mask.tree_attention`, every compact row once as
  query and once as key/value in one shared buffer under an ancestor-or-self mask,
  FlexAttention under ``torch.compile`` on CUDA (on CPU, where FlexAttention has no backward,
  the same mask densely);
* ``varlen_kernel_only``: the varlen call alone on keys/values gathered beforehand, to show
  the gather's share of ``gathered_varlen``.

Per microbatch and path: forward and forward+backward milliseconds (median over
``--attention-repeats`` calls after warm-up; forward runs with inputs that require grad, as
in training), the extra peak memory of one forward+backward (CUDA). One-time costs of the
tree path are kept out of those figures and reported on their own: the block-mask build
(first build, which includes compiling the mask function on the first microbatch, and a
rebuild) and the first forward+backward call (the FlexAttention compile for this row
count). Agreement: max abs difference of the outputs and of dq, dk, dv between
``gathered_varlen`` and ``flex_tree`` for the same inputs and output gradient, next to the
largest magnitude of each. ``faster_forward_backward`` names the faster path over the plan.

Run (H200)::

    PYTHONUNBUFFERED=1 harts bench --attention-bench --out bench_attention.json

CPU smoke test::

    harts bench --attention-bench --device cpu --preset tiny --tokens 800 --scale 0.004 --out /tmp/a.json
"""

from __future__ import annotations

import logging
import statistics
import time

import attrs
import numpy as np
import torch

from harts.codegen.fx import attention_kv_rows
from harts.codegen.layout import MicrobatchLayout
from harts.kernels import dispatch
from harts.kernels.attention import tree_mask as tree_attention
from harts.kernels.attention.varlen import flash_varlen_available
from harts.runtime.config import HybridConfig
from harts.runtime.tree_view import TreeView
from harts_bench.common import peak_memory_gib, reset_peak_memory, say, synchronize

logger = logging.getLogger(__name__)

__all__ = ["AttentionShape", "format_table", "run_attention_bench"]

PATHS = ("gathered_varlen", "varlen_kernel_only", "flex_tree")


@attrs.frozen
class AttentionShape:
    """Head layout of the model's full-attention layer, as its ``view.attention`` call sees it."""

    kind: str
    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    scale: float

    @classmethod
    def from_config(cls, config: HybridConfig) -> AttentionShape:
        if config.attention == "mla":
            # MLA hands the attention call per-head keys [k_nope; shared rope key] and narrower values
            qk = config.qk_nope_head_dim + config.qk_rope_head_dim
            return cls("mla", config.num_attention_heads, config.num_attention_heads, qk, config.v_head_dim, qk**-0.5)
        return cls(config.attention, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                   config.head_dim, config.head_dim**-0.5)


def _median_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _mask_build_seconds(parent: np.ndarray, device: torch.device) -> dict[str, float]:
    """The tree path's per-microbatch setup (preorder and block mask, shared by every attention layer),
    timed on its own: the first build (on the first microbatch it also compiles the mask function)
    and a rebuild."""
    timings = {}
    for name, use_cache in (("mask_build_seconds", True), ("mask_rebuild_seconds", False)):
        synchronize(device)
        start = time.perf_counter()
        tree_attention.prepare(parent, device, use_cache=use_cache)
        synchronize(device)
        timings[name] = time.perf_counter() - start
    return timings


def _path_functions(layout: MicrobatchLayout, shape: AttentionShape, device: torch.device):
    """name -> (inputs (q, k, v) -> o, how it turns the shared inputs into its own leaves)."""
    view = TreeView(layout, device=device, kernels=dispatch)
    parent = tree_attention.layout_parents(layout)
    kv_rows, kv_offsets = attention_kv_rows(layout)
    kv_index = torch.as_tensor(kv_rows, device=device)
    cu_q = torch.tensor(layout.seq_row_start, device=device)
    cu_k = torch.as_tensor(kv_offsets, device=device)

    def gathered(q, k, v):
        return view.attention(q, k, v, scale=shape.scale)

    def kernel_only(q, k_view, v_view):
        return dispatch.attention(q, k_view, v_view, cu_q, cu_k, scale=shape.scale, causal=True)

    def tree(q, k, v):
        return tree_attention.tree_attention(q, k, v, parent, scale=shape.scale)

    def pre_gather(q, k, v):
        return q, k.index_select(0, kv_index), v.index_select(0, kv_index)

    def as_is(q, k, v):
        return q, k, v

    return {"gathered_varlen": (gathered, as_is), "varlen_kernel_only": (kernel_only, pre_gather),
            "flex_tree": (tree, as_is)}, parent


def bench_layout(layout: MicrobatchLayout, shape: AttentionShape, device: torch.device, dtype: torch.dtype,
                 *, warmup: int, repeats: int, seed: int) -> dict:
    """Timings, memory, one-time costs and agreement of every path on one microbatch layout."""
    rows = layout.num_rows
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float32).to(dtype)

    q = randn(rows, shape.heads, shape.qk_head_dim)
    k = randn(rows, shape.kv_heads, shape.qk_head_dim)
    v = randn(rows, shape.kv_heads, shape.v_head_dim)
    grad_out = randn(rows, shape.heads, shape.v_head_dim)
    functions, parent = _path_functions(layout, shape, device)
    kv_rows, _ = attention_kv_rows(layout)
    entry: dict = {"microbatch": layout.microbatch, "rows": rows, "sequences": layout.num_sequences,
                   "gathered_kv_rows": int(kv_rows.shape[0]), "kv_duplication": int(kv_rows.shape[0]) / max(rows, 1)}

    results: dict[str, dict] = {}
    grads: dict[str, tuple] = {}
    for name in PATHS:
        fn, leaves_of = functions[name]
        leaves = out = first_grads = None
        try:
            leaves = [t.detach().requires_grad_() for t in leaves_of(q, k, v)]

            def forward(fn=fn, leaves=leaves):
                fn(*leaves)

            def forward_backward(fn=fn, leaves=leaves):
                torch.autograd.grad(fn(*leaves), leaves, grad_out)

            one_time = _mask_build_seconds(parent, device) if name == "flex_tree" else {}
            synchronize(device)
            start = time.perf_counter()
            out = fn(*leaves)
            first_grads = torch.autograd.grad(out, leaves, grad_out)
            synchronize(device)
            first_call = time.perf_counter() - start
            if name != "varlen_kernel_only":
                grads[name] = (out.detach(), *(g.detach() for g in first_grads))
            out = first_grads = None
            forward_ms = _median_ms(forward, device, warmup, repeats)
            forward_backward_ms = _median_ms(forward_backward, device, warmup, repeats)
            reset_peak_memory(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            forward_backward()
            synchronize(device)
            peak = peak_memory_gib(device)
            results[name] = {"forward_ms": forward_ms, "forward_backward_ms": forward_backward_ms,
                             "first_call_seconds": first_call,
                             "peak_extra_memory_gib": None if peak is None else peak - base / 2**30, **one_time}
        except RuntimeError as error:
            # one failing path (out of memory, a kernel without a config for these head dims) must not
            # lose the other paths' figures; the failure is recorded in the results
            logger.exception("attention bench: %s failed on microbatch %d", name, layout.microbatch)
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            out = first_grads = leaves = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    entry.update(results)

    if "gathered_varlen" in grads and "flex_tree" in grads:
        reference, other = grads["gathered_varlen"], grads["flex_tree"]
        entry["agreement"] = {
            name: {"max_abs_diff": _max_abs(a, b), "max_abs": float(a.float().abs().max())}
            for name, a, b in zip(("o", "dq", "dk", "dv"), reference, other)
        }
    for kind in ("forward_ms", "forward_backward_ms"):
        if kind in results["gathered_varlen"] and kind in results["flex_tree"]:
            entry.setdefault("speed_ratio", {})[kind.removesuffix("_ms")] = (
                results["gathered_varlen"][kind] / results["flex_tree"][kind])
    return entry


def _raise_recompile_limit(count: int) -> None:
    """tree_attention compiles FlexAttention with static shapes (one graph per row count); past
    dynamo's recompile limit it would fall back to eager FlexAttention, which materialises the
    full score matrix, so every microbatch of the plan must get its own graph."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < count + 2:
        logger.info("raising torch._dynamo.config.%s to %d for %d microbatch row counts", name, count + 2, count)
        setattr(config, name, count + 2)


def _varlen_backend(shape: AttentionShape, device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel ``dispatch.attention`` runs for inputs of this shape, dtype and device."""
    q = torch.zeros(1, shape.heads, shape.qk_head_dim, device=device, dtype=dtype)
    k = torch.zeros(1, shape.kv_heads, shape.qk_head_dim, device=device, dtype=dtype)
    v = torch.zeros(1, shape.kv_heads, shape.v_head_dim, device=device, dtype=dtype)
    if not dispatch.default.uses_fast_attention(q):
        return "pure-torch reference (harts.kernels.naive)"
    return "varlen FlashAttention-2" if flash_varlen_available(q, k, v) else "per-sequence SDPA"


def run_attention_bench(args, device: torch.device, config: HybridConfig, plan) -> dict:
    """The head-to-head on every (or the first ``args.attention_microbatches``) microbatch of ``plan``."""
    shape = AttentionShape.from_config(config)
    dtype = config.torch_dtype
    count = len(plan.module.microbatches)
    if args.attention_microbatches is not None:
        count = min(count, args.attention_microbatches)
    if device.type == "cuda":
        _raise_recompile_limit(count)
    backends = {
        "gathered_varlen": _varlen_backend(shape, device, dtype),
        "flex_tree": "FlexAttention (torch.compile)" if device.type == "cuda" else "dense mask (no FlexAttention backward on CPU)",
    }
    say(f"attention bench: {shape}, {dtype}, backends {backends}, {count} microbatch(es)")
    entries = []
    for microbatch in range(count):
        layout = plan.layout(microbatch)
        entry = bench_layout(layout, shape, device, dtype, warmup=max(args.warmup, 1),
                             repeats=args.attention_repeats, seed=args.seed + microbatch)
        entries.append(entry)
        say(f"attention bench: microbatch {microbatch} ({entry['rows']} rows, {entry['gathered_kv_rows']} gathered KV rows) "
            + ", ".join(f"{name} {entry[name].get('forward_backward_ms', float('nan')):.3f} ms fwd+bwd" for name in PATHS))
    totals: dict = {}
    for name in PATHS:
        if all("forward_ms" in entry[name] for entry in entries):
            totals[name] = {kind: sum(entry[name][kind] for entry in entries) for kind in ("forward_ms", "forward_backward_ms")}
    results = {"shape": attrs.asdict(shape), "dtype": str(dtype), "backends": backends, "microbatches": entries,
               "totals": totals}
    if "gathered_varlen" in totals and "flex_tree" in totals:
        results["speed_ratio"] = {
            kind.removesuffix("_ms"): totals["gathered_varlen"][kind] / totals["flex_tree"][kind]
            for kind in ("forward_ms", "forward_backward_ms")
        }
        faster = min(("gathered_varlen", "flex_tree"), key=lambda name: totals[name]["forward_backward_ms"])
        results["faster_forward_backward"] = faster
    return results


def format_table(results: dict) -> str:
    """Per-microbatch rows: ms per path, speed ratio (gathered / tree: above 1 means the tree path is faster), memory, agreement."""

    def cell(entry, name, key, fmt="{:.3f}"):
        value = entry.get(name, {}).get(key)
        return "-" if value is None else fmt.format(value)

    header = (f"{'mb':>3} {'rows':>8} {'kv rows':>9} | {'gathered fwd':>12} {'f+b':>9} | {'kernel f+b':>10} | "
              f"{'tree fwd':>9} {'f+b':>9} | {'ratio fwd':>9} {'f+b':>6} | {'mem g':>7} {'mem t':>7} | "
              f"{'|do|':>9} {'|dq|':>9} {'|dk|':>9} {'|dv|':>9}")
    lines = [header, "-" * len(header)]
    for entry in results["microbatches"]:
        ratio = entry.get("speed_ratio", {})
        agreement = entry.get("agreement", {})
        diffs = " ".join(f"{agreement[n]['max_abs_diff']:9.2e}" if n in agreement else f"{'-':>9}" for n in ("o", "dq", "dk", "dv"))
        lines.append(
            f"{entry['microbatch']:>3} {entry['rows']:>8} {entry['gathered_kv_rows']:>9} | "
            f"{cell(entry, 'gathered_varlen', 'forward_ms'):>12} {cell(entry, 'gathered_varlen', 'forward_backward_ms'):>9} | "
            f"{cell(entry, 'varlen_kernel_only', 'forward_backward_ms'):>10} | "
            f"{cell(entry, 'flex_tree', 'forward_ms'):>9} {cell(entry, 'flex_tree', 'forward_backward_ms'):>9} | "
            f"{ratio.get('forward', float('nan')):>9.3f} {ratio.get('forward_backward', float('nan')):>6.3f} | "
            f"{cell(entry, 'gathered_varlen', 'peak_extra_memory_gib', '{:.3f}'):>7} "
            f"{cell(entry, 'flex_tree', 'peak_extra_memory_gib', '{:.3f}'):>7} | {diffs}"
        )
    lines.append("(ms per microbatch, median; ratio = gathered_varlen / flex_tree, above 1: the tree path is faster; "
                 "mem = extra peak GiB of one forward+backward; |dx| = max abs difference gathered vs tree)")
    for entry in results["microbatches"]:
        tree = entry.get("flex_tree", {})
        if "first_call_seconds" in tree:
            lines.append(f"mb {entry['microbatch']}: tree one-time costs: mask build {tree['mask_build_seconds']:.3f} s "
                         f"(rebuild {tree['mask_rebuild_seconds']:.3f} s), first call (compile) {tree['first_call_seconds']:.3f} s")
        for name in PATHS:
            if "error" in entry.get(name, {}):
                lines.append(f"mb {entry['microbatch']}: {name} failed: {entry[name]['error'][:300]}")
    if "speed_ratio" in results:
        totals = results["totals"]
        lines.append(
            f"total: gathered_varlen {totals['gathered_varlen']['forward_ms']:.3f} / {totals['gathered_varlen']['forward_backward_ms']:.3f} ms, "
            f"flex_tree {totals['flex_tree']['forward_ms']:.3f} / {totals['flex_tree']['forward_backward_ms']:.3f} ms (fwd / fwd+bwd); "
            f"ratio {results['speed_ratio']['forward']:.3f} / {results['speed_ratio']['forward_backward']:.3f}; "
            f"faster forward+backward: {results['faster_forward_backward']}"
        )
    return "\n".join(lines)
