"""Chunkwise gated delta rule (KDA, Gated DeltaNet) on flash-linear-attention, with HARTS' contract.

Same signature and results as :func:`harts.kernels.linear_attention.naive.chunk_linear_attention`
(Eq. 16 of the paper): one packed varlen call with per-sequence initial states, returning the
outputs, every sequence's final state and the chunk-boundary states the plan requests, all
states in fp32; the exported states stay in the autograd graph, so the rounds that start from
them send their gradients back into this call.

The call is fla's KDA chunk pipeline with its two state kernels replaced by ours
(:mod:`.state`), which write the requested boundary states during the forward state scan and
add their gradients into the reverse state-gradient scan at their boundary:

    forward:  chunk_local_cumsum -> chunk_kda_fwd_intra (w, u, kg, Aqk, Akk)
              -> scan_forward (h, v_new, final and exported states) -> chunk_gla_fwd_o_gk (o)
    backward: recompute_w_u_fwd -> scan_forward (h, v_new again) -> chunk_kda_bwd_dAv
              -> scan_backward (dh, dh0, dv; exported-state gradients injected)
              -> chunk_kda_bwd_wy_dqkg_fused -> chunk_kda_bwd_intra -> reverse chunk_local_cumsum

which is what fla's own ``chunk_kda`` runs, kernel for kernel, so a sequence's outputs,
states and gradients equal stock ``chunk_kda``'s on the same rows (its forward is also batch
invariant: a sequence packed with others gives the outputs it gives alone). Gated DeltaNet's
per-head gate [T, H] takes the same route broadcast over the key channels ([T, H, K]): the same
recurrence, and fla's Gated DeltaNet backward refuses Triton < 3.7.1 on Hopper.

Bounds: CUDA, chunk size 32 or 64 (fla's KDA kernels), head dims <= 256, q/k/v of one dtype
(bf16, fp16 or fp32). :mod:`harts.kernels` dispatches here only for inputs inside them.

Autotuning: fla tunes its kernels on first use (minutes). :func:`harts.kernels.fla_setup.configure_fla`
points fla at the configs shipped in ``kernels/fla_configs/<GPU>/`` (tuned on that GPU by
``benchmarks/tune_fla.py``) before fla is first imported, unless the user set
``FLA_CACHE_MODE`` / ``FLA_CONFIG_DIR``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from harts.options import FAST_KERNEL_CHUNK_SIZES

from .. import host
from ..fla_setup import configure_fla
from .naive import check_export_chunks, check_linear_attention_inputs
from .state import MAX_HEAD_DIM, scan_backward, scan_forward

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_CHUNK_SIZES", "chunk_linear_attention", "configure_fla", "fla_available", "keep_backward_intermediates",
           "stock_chunk_kda"]

#: one list, the compiler's: a plan compiled with ``fast_kernels=True`` has one of these chunk sizes
SUPPORTED_CHUNK_SIZES = FAST_KERNEL_CHUNK_SIZES
_LAYOUT_CACHE_SIZE = 128
_fla = None


def _load_fla():
    """Import the fla pieces once (after :func:`configure_fla`); None when fla is not installed."""
    global _fla
    if _fla is None:
        configure_fla()
        try:
            from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
            from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra, chunk_kda_fwd_intra
            from fla.ops.kda.wy_fast import recompute_w_u_fwd
            from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
            from fla.ops.utils import chunk_local_cumsum
            from fla.ops.utils.constant import RCP_LN2
        except ImportError:
            _fla = False
            return None
        _fla = {
            "chunk_local_cumsum": chunk_local_cumsum,
            "fwd_intra": chunk_kda_fwd_intra,
            "fwd_o": chunk_gla_fwd_o_gk,
            "recompute_w_u": recompute_w_u_fwd,
            "bwd_dAv": chunk_kda_bwd_dAv,
            "bwd_wy": chunk_kda_bwd_wy_dqkg_fused,
            "bwd_intra": chunk_kda_bwd_intra,
            "rcp_ln2": RCP_LN2,
        }
    return _fla or None


def fla_available() -> bool:
    """Whether flash-linear-attention imports here."""
    return _load_fla() is not None


class _CallLayout:
    """Index tensors of one packed call (bounds, chunk size, export requests, device), built once."""

    def __init__(self, bounds: np.ndarray, chunk_size: int, requests: list[tuple[int, int]], device: torch.device):
        lengths = np.diff(bounds)
        counts = -(-lengths // chunk_size)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_chunks = int(offsets[-1])
        # every index tensor is built on the host and uploaded from pinned memory (harts.kernels.host): a copy
        # from pageable memory, or fla's prepare_chunk_indices (it reads cu_seqlens back), waits for the GPU
        self.cu_seqlens = host.upload(bounds, device, torch.long)
        self.chunk_offsets = host.upload(offsets, device)
        self.chunk_indices = host.upload(chunk_indices(offsets, self.num_chunks), device)
        chunk_export = np.full(self.num_chunks, -1, dtype=np.int32)
        final_export = np.full(len(lengths), -1, dtype=np.int32)
        unique: dict[tuple[int, int], int] = {}
        request_slot = []
        for sequence, chunks in requests:
            slot = unique.setdefault((sequence, chunks), len(unique))
            request_slot.append(slot)
            if chunks < counts[sequence]:
                chunk_export[offsets[sequence] + chunks] = slot
            else:
                final_export[sequence] = slot
        self.num_exports = len(unique)
        self.chunk_export = host.upload(chunk_export, device)
        self.final_export = host.upload(final_export, device)
        # a state requested twice is written once; index_select hands it to both requests
        identity = request_slot == list(range(len(request_slot)))
        self.request_slot = None if identity else host.upload(np.asarray(request_slot, dtype=np.int64), device)


def chunk_indices(chunk_offsets: np.ndarray, num_chunks: int) -> np.ndarray:
    """fla's ``prepare_chunk_indices`` on the host: [NT, 2] int64 (sequence, chunk within it) per chunk, as
    fla 0.6's segmented arange numbers them (an empty sequence keeps its number and owns no chunk)."""
    counts = np.diff(chunk_offsets)
    within = np.arange(num_chunks, dtype=np.int64) - np.repeat(chunk_offsets[:-1], counts)
    return np.stack([np.repeat(np.arange(counts.size, dtype=np.int64), counts), within], axis=1)


_layouts: OrderedDict = OrderedDict()


def _call_layout(bounds: np.ndarray, chunk_size: int, requests: list[tuple[int, int]], device: torch.device) -> _CallLayout:
    # every layer of a microbatch makes the same calls: build their index tensors once
    key = (bounds.tobytes(), chunk_size, tuple(requests), str(device))
    layout = _layouts.get(key)
    if layout is None:
        layout = _CallLayout(bounds, chunk_size, requests, device)
        _layouts[key] = layout
        if len(_layouts) > _LAYOUT_CACHE_SIZE:
            _layouts.popitem(last=False)
    else:
        _layouts.move_to_end(key)
    return layout


class _Keeping(threading.local):
    on = False


_keeping = _Keeping()


@contextlib.contextmanager
def keep_backward_intermediates():
    """Inside this context the chunk calls save w, u, q·g, k·g, the chunk states h and v_new for their
    backward instead of recomputing them there.

    Meant for the body of an activation-checkpointed region (non-reentrant or reentrant), entered by the
    checkpointed function itself so that it holds in the recompute too: the region's first forward has
    its saved tensors dropped by the checkpoint, and the recompute's are held only until the region's
    backward, which then skips a w/u kernel and a state scan per call. Outside such a region it would
    keep every layer's intermediates alive until the backward: several times the saved activations.
    """
    previous = _keeping.on
    _keeping.on = True
    try:
        yield
    finally:
        _keeping.on = previous


@contextlib.contextmanager
def intermediates_kept_in_recompute(on: bool = True):
    """Turn :attr:`ChunkGatedDeltaRule.keep_intermediates_in_recompute` on (or off) for the duration of the
    context, process-wide, and restore its value after."""
    previous = ChunkGatedDeltaRule.keep_intermediates_in_recompute
    ChunkGatedDeltaRule.keep_intermediates_in_recompute = on
    try:
        yield
    finally:
        ChunkGatedDeltaRule.keep_intermediates_in_recompute = previous


class ChunkGatedDeltaRule(torch.autograd.Function):
    """(q, k, v, g, beta, initial_state) -> (o, final_state, exported); tensors [1, T, H, *].

    The backward needs w, u, q·g, k·g, the chunk states h and v_new. By default, like fla, a forward
    saves only its inputs and the intra-chunk matrices and the backward recomputes the rest; inside
    :func:`keep_backward_intermediates` the forward keeps them (fla's ``disable_recompute``). The kept
    tensors are the ones the recompute gives, bit for bit: the same kernels on the same inputs.
    The context takes effect only while ``keep_intermediates_in_recompute`` is on (see
    :func:`intermediates_kept_in_recompute`).
    """

    #: off by default until the GPU tests of the kept path (``tests/kernels/test_linear_attention_chunk.py``,
    #: bit-for-bit gradients against the recomputing path) have run on a GPU: a wrong gradient here would
    #: train silently wrong, and the recomputing path is the one measured and verified so far
    keep_intermediates_in_recompute = False

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, layout: _CallLayout, scale: float, chunk_size: int):
        fla = _load_fla()
        keep = ChunkGatedDeltaRule.keep_intermediates_in_recompute and _keeping.on
        common = {"cu_seqlens": layout.cu_seqlens, "chunk_size": chunk_size, "chunk_indices": layout.chunk_indices}
        g_cumsum = fla["chunk_local_cumsum"](g, scale=fla["rcp_ln2"], **common)
        w, u, qg, kg, Aqk, Akk = fla["fwd_intra"](q=q, k=k, v=v, gk=g_cumsum, beta=beta, scale=scale,
                                                  disable_recompute=keep, **common)
        h, v_new, final_state, exported = scan_forward(
            kg[0], w[0], u[0], g_cumsum[0], initial_state, layout.cu_seqlens, layout.chunk_offsets,
            layout.chunk_export, layout.final_export, layout.num_exports, chunk_size, num_chunks=layout.num_chunks,
        )
        o = fla["fwd_o"](q=q, v=v_new.unsqueeze(0), g=g_cumsum, A=Aqk, h=h.unsqueeze(0), scale=scale, **common)
        kept = (w, u, qg, kg, h, v_new) if keep else ()
        ctx.save_for_backward(q, k, v, g_cumsum, beta, Aqk, Akk, initial_state, *kept)
        ctx.layout, ctx.scale, ctx.chunk_size = layout, scale, chunk_size
        ctx.set_materialize_grads(False)
        return o.to(q.dtype), final_state, exported

    @staticmethod
    def backward(ctx, do, d_final, d_exported):
        fla = _load_fla()
        q, k, v, g, beta, Aqk, Akk, initial_state, *kept = ctx.saved_tensors
        layout, scale, chunk_size = ctx.layout, ctx.scale, ctx.chunk_size
        common = {"cu_seqlens": layout.cu_seqlens, "chunk_size": chunk_size, "chunk_indices": layout.chunk_indices}
        if do is None:
            do = torch.zeros_like(v)
        do = do.contiguous()
        if kept:
            w, u, qg, kg, h, v_new = kept
        else:
            w, u, qg, kg = fla["recompute_w_u"](
                k=k, v=v, beta=beta, A=Akk, gk=g, q=q, cu_seqlens=layout.cu_seqlens, chunk_indices=layout.chunk_indices
            )
            h, v_new, _, _ = scan_forward(
                kg[0], w[0], u[0], g[0], initial_state, layout.cu_seqlens, layout.chunk_offsets, None, None, 0,
                chunk_size, num_chunks=layout.num_chunks,
            )
        v_new = v_new.unsqueeze(0)
        dAqk, dv = fla["bwd_dAv"](q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, **common)
        dh, dh0, dv = scan_backward(
            qg[0], kg[0], w[0], g[0], do[0], dv[0],
            None if d_final is None else d_final.contiguous(),
            None if d_exported is None else d_exported.contiguous(),
            initial_state is not None, layout.cu_seqlens, layout.chunk_offsets,
            layout.chunk_export, layout.final_export, scale, chunk_size, num_chunks=layout.num_chunks,
        )
        dq, dk, dv, db, dg, dAkk = fla["bwd_wy"](
            q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=Akk, h=h.unsqueeze(0), do=do, dh=dh.unsqueeze(0),
            dv=dv.unsqueeze(0), scale=scale, **common,
        )
        dq, dk, db, dg = fla["bwd_intra"](
            q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, **common
        )
        dg = fla["chunk_local_cumsum"](dg, reverse=True, **common)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db.to(beta.dtype), dh0, None, None, None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    """Whether this path covers these inputs (and fla is installed)."""
    return (
        q.is_cuda
        and chunk_size in SUPPORTED_CHUNK_SIZES
        and q.dim() == 3
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] <= MAX_HEAD_DIM
        and v.shape[-1] <= MAX_HEAD_DIM
        and fla_available()
    )


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    chunk_size: int,
    scale: float,
    initial_state: torch.Tensor | None = None,
    export_chunks: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`harts.kernels.linear_attention.naive.chunk_linear_attention`; states come back in fp32."""
    if _load_fla() is None:
        raise RuntimeError("this linear-attention path needs flash-linear-attention (pip install flash-linear-attention)")
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"fla's chunkwise KDA kernels take chunk sizes {SUPPORTED_CHUNK_SIZES}, got {chunk_size}")
    bounds = check_linear_attention_inputs(q, k, v, log_decay, beta, cu_seqlens, chunk_size, initial_state)
    total, heads, key_dim = q.shape
    requests = check_export_chunks(export_chunks, -(-np.diff(bounds) // chunk_size))
    layout = _call_layout(bounds, chunk_size, requests, q.device)
    gate = log_decay if log_decay.dim() == 3 else log_decay.unsqueeze(-1).expand(total, heads, key_dim)
    state = None if initial_state is None else initial_state.float().contiguous()
    o, final_state, exported = ChunkGatedDeltaRule.apply(
        q.contiguous().unsqueeze(0), k.contiguous().unsqueeze(0), v.contiguous().unsqueeze(0),
        gate.float().contiguous().unsqueeze(0), beta.to(q.dtype).contiguous().unsqueeze(0),
        state, layout, float(scale), chunk_size,
    )
    if layout.request_slot is not None:
        exported = exported.index_select(0, layout.request_slot)
    return o[0], final_state, exported


def stock_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    chunk_size: int,
    scale: float,
    initial_state: torch.Tensor | None = None,
    export_chunks: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's public ``chunk_kda``, called as a trajectory-wise trainer calls it (the baseline's kernel).

    Same signature as :func:`chunk_linear_attention` so that a baseline view can run it; it has
    no boundary-state exports (stock fla cannot return them), and Gated DeltaNet's per-head gate
    takes the KDA route broadcast over K (fla's own Gated DeltaNet backward refuses Triton < 3.7.1
    on Hopper). Zero initial states are passed explicitly, as fla returns the initial-state
    gradient only when it is given one (and a trainer passes none).
    """
    if any(export_chunks or ()):
        raise ValueError("stock fla cannot export chunk-boundary states; the trajectory-wise baseline never asks")
    if _load_fla() is None:  # also points fla at the pinned configs before its first import
        raise RuntimeError("the stock-fla baseline needs flash-linear-attention (pip install flash-linear-attention)")
    from fla.ops.kda import chunk_kda

    check_linear_attention_inputs(q, k, v, log_decay, beta, cu_seqlens, chunk_size, initial_state)
    total, heads, key_dim = q.shape
    gate = log_decay if log_decay.dim() == 3 else log_decay.unsqueeze(-1).expand(total, heads, key_dim)
    o, final_state = chunk_kda(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), gate.float().contiguous().unsqueeze(0),
        beta.to(q.dtype).unsqueeze(0), scale=scale, output_final_state=True,
        initial_state=None if initial_state is None else initial_state.float(),
        cu_seqlens=cu_seqlens.long(), chunk_size=chunk_size,
    )
    return o[0], final_state, q.new_zeros(0, heads, key_dim, v.shape[-1], dtype=torch.float32)
