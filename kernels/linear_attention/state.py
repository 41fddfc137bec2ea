"""Cross-chunk state kernels of the chunkwise gated delta rule, with HARTS' contract (Eq. 16).

flash-linear-attention splits a chunkwise KDA / Gated DeltaNet call into intra-chunk kernels
(cumulative gates, the WY / UT transform, the output) and two state kernels: a forward scan
over chunks that writes the state at every chunk start, and a reverse scan that carries the
state gradient back. Its state kernels return only the final state and take only the final
state's gradient. HARTS needs two things more, in the same scans:

* forward: the chunk-boundary states the plan requests (``exported``), written in fp32 from
  the scan's register state, so later rounds can start from them exactly; no second scan;
* backward: the gradients that later rounds send to those exported states, added to the
  running state gradient at their boundary, so they flow into everything the state came from.

These two kernels are our variants of fla's ``chunk_gated_delta_rule_fwd_h`` and
``chunk_gated_delta_rule_bwd_dhu`` for the per-key-channel gate path (KDA; Gated DeltaNet is
run through it with its per-head gate broadcast over K). They keep fla's arithmetic step for
step (the same operand dtypes for every ``tl.dot``, the same order of updates), so a sequence's
states, outputs and gradients equal stock fla's bit for bit, and an exported state equals the
state a trajectory-wise run carries in registers across that boundary.

Notation, per sequence and head, chunk ``c`` of ``B = BT`` rows (fla's inputs)::

    kg   [T, H, K]  keys decayed to their chunk's end      w   [T, H, K]  WY state weights
    u    [T, H, V]  state-free written values              gk  [T, H, K]  chunk-local cumulative log2 gate
    h_c             state at the start of chunk c (h_0 = the initial state)
    v_c  = u_c - w_c h_c                                   (v_new, what chunk c writes)
    h_{c+1} = Diag(2^{gk_last,c}) h_c + kg_c^T v_c

Exports are addressed by two int32 maps: ``chunk_export[j]`` (global chunk j, j > its
sequence's first chunk) names the exported slot that receives h at the start of chunk j,
or -1; ``final_export[i]`` names the slot that receives sequence i's final state, or -1.
The backward kernel reads the same maps to inject ``d_exported``.

Triton is optional: without it this module imports and the kernels raise on use. On CPU the
kernels run under the Triton interpreter (``TRITON_INTERPRET=1``), which is how CI holds them
to :func:`scan_reference`.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional on CPU machines
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
    TRITON_AVAILABLE = False

__all__ = [
    "MAX_HEAD_DIM",
    "TRITON_AVAILABLE",
    "interpreter_enabled",
    "scan_backward",
    "scan_forward",
    "scan_reference",
]

MAX_HEAD_DIM = 256


def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if TRITON_AVAILABLE:

    @triton.jit
    def _chunk_rows(bos, eos, i_t, BT: tl.constexpr):
        rows = bos + i_t * BT + tl.arange(0, BT)
        last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
        return rows, rows < eos, last

    @triton.jit
    def _forward_step(
        b_h, i_t, first_chunk, bos, eos, head, kg, w, u, gk, h, v_new, exported, chunk_export,
        keys, key_ok, cols, col_ok, in_state, state_ok,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, HAS_EXPORTS: tl.constexpr,
    ):
        chunk = first_chunk + i_t
        tl.store(h + (chunk * H + head) * K * V + in_state, b_h.to(h.dtype.element_ty), mask=state_ok)
        if HAS_EXPORTS:
            slot = tl.load(chunk_export + chunk).to(tl.int64)
            tl.store(exported + (tl.maximum(slot, 0) * H + head) * K * V + in_state, b_h, mask=state_ok & (in_state * 0 + slot >= 0))
        rows, row_ok, last = _chunk_rows(bos, eos, i_t, BT)
        b_w = tl.load(w + (rows[:, None] * H + head) * K + keys[None, :],
                      mask=row_ok[:, None] & key_ok[None, :], other=0.0)  # [BT, BK]
        b_v = tl.dot(b_w, b_h.to(b_w.dtype))  # [BT, BV]
        value_offsets = (rows[:, None] * H + head) * V + cols[None, :]
        value_ok = row_ok[:, None] & col_ok[None, :]
        b_v = tl.load(u + value_offsets, mask=value_ok, other=0.0) - b_v
        tl.store(v_new + value_offsets, b_v.to(v_new.dtype.element_ty), mask=value_ok)
        b_gate = tl.load(gk + (last * H + head) * K + keys, mask=key_ok, other=0.0).to(tl.float32)
        b_h *= tl.math.exp2(b_gate)[:, None]
        b_v = b_v.to(kg.dtype.element_ty)
        b_k = tl.load(kg + (rows[None, :] * H + head) * K + keys[:, None],
                      mask=key_ok[:, None] & row_ok[None, :], other=0.0)  # [BK, BT]
        return tl.dot(b_k, b_v, b_h)

    @triton.jit
    def _scan_forward_kernel(
        kg,  # [T, H, K]
        w,  # [T, H, K]
        u,  # [T, H, V]
        gk,  # [T, H, K] fp32, chunk-local cumulative log2 gate
        h,  # [NT, H, K, V] out, kg's dtype: state at every chunk start
        v_new,  # [T, H, V] out, u's dtype
        h0,  # [N, H, K, V] fp32 (read when USE_INITIAL_STATE)
        ht,  # [N, H, K, V] fp32 out: final states
        exported,  # [E, H, K, V] fp32 out (written when HAS_EXPORTS)
        chunk_export,  # [NT] int32
        final_export,  # [N] int32
        cu_seqlens,  # [N + 1]
        chunk_offsets,  # [N + 1]
        H: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
        HAS_EXPORTS: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
    ):
        i_v = tl.program_id(0)
        i_nh = tl.program_id(1).to(tl.int64)
        i_n = i_nh // H
        head = i_nh % H
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        first_chunk = tl.load(chunk_offsets + i_n).to(tl.int64)
        count = tl.load(chunk_offsets + i_n + 1).to(tl.int64) - first_chunk

        keys = tl.arange(0, BK)
        key_ok = keys < K
        cols = i_v * BV + tl.arange(0, BV)
        col_ok = cols < V
        in_state = keys[:, None] * V + cols[None, :]  # offsets inside one [K, V] state
        state_ok = key_ok[:, None] & col_ok[None, :]

        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_h += tl.load(h0 + i_nh * K * V + in_state, mask=state_ok, other=0.0).to(tl.float32)
        # The interpreter cannot take a loaded bound in range(); compiled code wants range()
        # so that the next chunk's loads are pipelined.
        if WHILE_LOOP:
            i_t = count * 0
            while i_t < count:
                b_h = _forward_step(b_h, i_t, first_chunk, bos, eos, head, kg, w, u, gk, h, v_new, exported,
                                    chunk_export, keys, key_ok, cols, col_ok, in_state, state_ok, H, K, V, BT,
                                    HAS_EXPORTS)
                i_t += 1
        else:
            for i_t in range(count):
                b_h = _forward_step(b_h, i_t, first_chunk, bos, eos, head, kg, w, u, gk, h, v_new, exported,
                                    chunk_export, keys, key_ok, cols, col_ok, in_state, state_ok, H, K, V, BT,
                                    HAS_EXPORTS)

        tl.store(ht + i_nh * K * V + in_state, b_h, mask=state_ok)
        if HAS_EXPORTS:
            slot = tl.load(final_export + i_n).to(tl.int64)
            tl.store(exported + (tl.maximum(slot, 0) * H + head) * K * V + in_state, b_h, mask=state_ok & (in_state * 0 + slot >= 0))

    @triton.jit
    def _backward_step(
        b_dh, i_t, first_chunk, bos, eos, head, qg, kg, w, gk, d_exported, do, dh, dv, dv2, chunk_export, scale,
        keys, key_ok, cols, col_ok, in_state, state_ok,
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, HAS_EXPORTS: tl.constexpr,
    ):
        chunk = first_chunk + i_t
        tl.store(dh + (chunk * H + head) * K * V + in_state, b_dh.to(dh.dtype.element_ty), mask=state_ok)
        rows, row_ok, last = _chunk_rows(bos, eos, i_t, BT)
        value_offsets = (rows[:, None] * H + head) * V + cols[None, :]
        value_ok = row_ok[:, None] & col_ok[None, :]
        b_do = tl.load(do + value_offsets, mask=value_ok, other=0.0)
        b_k = tl.load(kg + (rows[:, None] * H + head) * K + keys[None, :],
                      mask=row_ok[:, None] & key_ok[None, :], other=0.0)  # [BT, BK]
        b_dv = tl.dot(b_k, b_dh.to(b_k.dtype))  # [BT, BV]
        b_dv += tl.load(dv + value_offsets, mask=value_ok, other=0.0)
        tl.store(dv2 + value_offsets, b_dv.to(dv2.dtype.element_ty), mask=value_ok)

        transposed = (rows[None, :] * H + head) * K + keys[:, None]
        transposed_ok = key_ok[:, None] & row_ok[None, :]
        b_q = tl.load(qg + transposed, mask=transposed_ok, other=0.0)  # [BK, BT]
        b_w = tl.load(w + transposed, mask=transposed_ok, other=0.0)  # [BK, BT]
        b_gate = tl.load(gk + (last * H + head) * K + keys, mask=key_ok, other=0.0).to(tl.float32)
        b_dh *= tl.math.exp2(b_gate)[:, None]
        b_dh += tl.dot(b_q, b_do.to(b_q.dtype)) * scale - tl.dot(b_w, b_dv.to(b_w.dtype))
        if HAS_EXPORTS:
            # b_dh is now the gradient of the state at this chunk's start: add what the later
            # rounds that started from this state (exported) sent back
            slot = tl.load(chunk_export + chunk).to(tl.int64)
            b_dh += tl.load(d_exported + (tl.maximum(slot, 0) * H + head) * K * V + in_state,
                            mask=state_ok & (in_state * 0 + slot >= 0), other=0.0)
        return b_dh

    @triton.jit(do_not_specialize=["scale"])
    def _scan_backward_kernel(
        qg,  # [T, H, K] queries with their in-chunk decay
        kg,  # [T, H, K]
        w,  # [T, H, K]
        gk,  # [T, H, K] fp32
        dht,  # [N, H, K, V] fp32 (read when USE_FINAL_GRADIENT)
        dh0,  # [N, H, K, V] fp32 out (written when USE_INITIAL_STATE)
        d_exported,  # [E, H, K, V] fp32 (read when HAS_EXPORTS)
        do,  # [T, H, V]
        dh,  # [NT, H, K, V] out, qg's dtype: gradient of the state at every chunk end
        dv,  # [T, H, V] gradient of v_new from the outputs
        dv2,  # [T, H, V] out: dv plus the path through the state updates
        chunk_export,  # [NT] int32
        final_export,  # [N] int32
        cu_seqlens,
        chunk_offsets,
        scale,
        H: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
        USE_FINAL_GRADIENT: tl.constexpr,
        HAS_EXPORTS: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
    ):
        i_v = tl.program_id(0)
        i_nh = tl.program_id(1).to(tl.int64)
        i_n = i_nh // H
        head = i_nh % H
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        first_chunk = tl.load(chunk_offsets + i_n).to(tl.int64)
        count = tl.load(chunk_offsets + i_n + 1).to(tl.int64) - first_chunk

        keys = tl.arange(0, BK)
        key_ok = keys < K
        cols = i_v * BV + tl.arange(0, BV)
        col_ok = cols < V
        in_state = keys[:, None] * V + cols[None, :]
        state_ok = key_ok[:, None] & col_ok[None, :]

        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_FINAL_GRADIENT:
            b_dh += tl.load(dht + i_nh * K * V + in_state, mask=state_ok, other=0.0)
        if HAS_EXPORTS:
            slot = tl.load(final_export + i_n).to(tl.int64)
            b_dh += tl.load(d_exported + (tl.maximum(slot, 0) * H + head) * K * V + in_state,
                            mask=state_ok & (in_state * 0 + slot >= 0), other=0.0)

        if WHILE_LOOP:
            i_t = count - 1
            while i_t >= 0:
                b_dh = _backward_step(b_dh, i_t, first_chunk, bos, eos, head, qg, kg, w, gk, d_exported, do, dh, dv,
                                      dv2, chunk_export, scale, keys, key_ok, cols, col_ok, in_state, state_ok,
                                      H, K, V, BT, HAS_EXPORTS)
                i_t -= 1
        else:
            for i_t in range(count - 1, -1, -1):
                b_dh = _backward_step(b_dh, i_t, first_chunk, bos, eos, head, qg, kg, w, gk, d_exported, do, dh, dv,
                                      dv2, chunk_export, scale, keys, key_ok, cols, col_ok, in_state, state_ok,
                                      H, K, V, BT, HAS_EXPORTS)

        if USE_INITIAL_STATE:
            tl.store(dh0 + i_nh * K * V + in_state, b_dh, mask=state_ok)


def _check_runnable(device: torch.device) -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("the linear-attention state kernels need Triton, which is not installed")
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"the linear-attention state kernels run on CUDA (got a {device.type} tensor); "
            "on CPU set TRITON_INTERPRET=1 before importing triton"
        )


#: CTAs per multiprocessor below which a scan splits its value columns finer (forward, reverse),
#: from timing both on the headline plan's rounds on an H200 (benchmarks/RESULTS.md)
_MIN_PROGRAMS_PER_SM = {"forward": 2, "reverse": 1}
_SM_COUNTS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _launch_shape(value_dim: int, dtype: torch.dtype, state_programs: int, device: torch.device,
                  block_v: int | None = None, scan: str = "forward") -> tuple[int, int]:
    """(value-column block, pipeline stages) for ``state_programs`` (sequence, head) pairs.

    fla's tuned H200 choice for 16-bit operands is 64 columns in 2 stages; fp32 tiles take twice
    the shared memory, so they get 32 and no pipelining. A scan runs its chunks one after
    another, so a call with few sequences (a plan's first rounds: one long shared prompt) is
    latency-bound on too few CTAs; below two per multiprocessor (one for the reverse scan, whose
    steps are heavier) the columns split finer (down to 16), which shortens each step and fills
    the GPU; such a forward scan also prefetches one chunk further (3 stages: the headline's one-sequence
    round 0.113 -> 0.085 ms, its 8-sequence round 0.243 -> 0.232 ms, while the reverse scan and the wider
    rounds gained nothing or lost; ``benchmarks/bench_state_blocks.py``). A column's arithmetic does not
    depend on the block it sits in or on the launch, so results do not change (the bench checks bitwise).
    """
    stages = 2 if dtype.itemsize <= 2 else 1
    if block_v is not None:
        if block_v < 16 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
        return block_v, stages
    widest = min(64 if dtype.itemsize <= 2 else 32, max(16, _next_power_of_2(value_dim)))
    block_v = widest
    wanted = _MIN_PROGRAMS_PER_SM[scan] * _multiprocessors(device)
    while block_v > 16 and -(-value_dim // block_v) * state_programs < wanted:
        block_v //= 2
    if scan == "forward" and dtype.itemsize <= 2 and block_v < widest:
        stages = 3  # a latency-bound forward scan gains from prefetching one chunk further ahead
    return block_v, stages


def scan_forward(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gk: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    chunk_export: torch.Tensor | None,
    final_export: torch.Tensor | None,
    num_exports: int,
    chunk_size: int,
    *,
    num_chunks: int | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward state scan; tensors are [T, H, *] (no batch dim).

    Returns ``h`` [NT, H, K, V] (kg's dtype), ``v_new`` [T, H, V] (u's dtype), the final states
    [N, H, K, V] and the exported states [E, H, K, V] (both fp32). ``num_chunks`` (NT, the last
    entry of ``chunk_offsets``) should come from the host: reading it from a CUDA tensor waits for
    the whole queue. ``block_v`` overrides the value-column block (:func:`_launch_shape`); ``num_warps`` and
    ``num_stages`` the launch (``benchmarks/bench_state_blocks.py`` times the choices).
    """
    _check_runnable(kg.device)
    total, heads, key_dim = kg.shape
    value_dim = u.shape[-1]
    num_sequences = cu_seqlens.numel() - 1
    if num_chunks is None:
        num_chunks = int(chunk_offsets[-1]) if chunk_offsets.numel() else 0
    h = kg.new_empty(num_chunks, heads, key_dim, value_dim)
    v_new = torch.empty_like(u)
    final_state = kg.new_empty(num_sequences, heads, key_dim, value_dim, dtype=torch.float32)
    exported = kg.new_empty(num_exports, heads, key_dim, value_dim, dtype=torch.float32)
    has_exports = num_exports > 0
    dummy = final_state
    block_v, stages = _launch_shape(value_dim, kg.dtype, num_sequences * heads, kg.device, block_v)
    grid = (triton.cdiv(value_dim, block_v), num_sequences * heads)
    if grid[1] == 0:
        return h, v_new, final_state, exported
    _scan_forward_kernel[grid](
        kg, w, u, gk, h, v_new,
        initial_state if initial_state is not None else dummy,
        final_state,
        exported if has_exports else dummy,
        chunk_export if has_exports else cu_seqlens,
        final_export if has_exports else cu_seqlens,
        cu_seqlens, chunk_offsets,
        H=heads, K=key_dim, V=value_dim, BT=chunk_size, BK=max(16, _next_power_of_2(key_dim)), BV=block_v,
        USE_INITIAL_STATE=initial_state is not None, HAS_EXPORTS=has_exports, WHILE_LOOP=interpreter_enabled(),
        num_warps=num_warps, num_stages=stages if num_stages is None else num_stages,
    )
    return h, v_new, final_state, exported


def scan_backward(
    qg: torch.Tensor,
    kg: torch.Tensor,
    w: torch.Tensor,
    gk: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor,
    d_final: torch.Tensor | None,
    d_exported: torch.Tensor | None,
    has_initial_state: bool,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    chunk_export: torch.Tensor | None,
    final_export: torch.Tensor | None,
    scale: float,
    chunk_size: int,
    *,
    num_chunks: int | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reverse state scan: ``dh`` [NT, H, K, V] (qg's dtype), ``dh0`` [N, H, K, V] fp32 (or None), ``dv2``;
    ``num_chunks``, ``block_v``, ``num_warps`` and ``num_stages`` as in :func:`scan_forward`."""
    _check_runnable(qg.device)
    total, heads, key_dim = qg.shape
    value_dim = do.shape[-1]
    num_sequences = cu_seqlens.numel() - 1
    if num_chunks is None:
        num_chunks = int(chunk_offsets[-1]) if chunk_offsets.numel() else 0
    dh = qg.new_empty(num_chunks, heads, key_dim, value_dim)
    dv2 = torch.empty_like(dv)
    dh0 = qg.new_empty(num_sequences, heads, key_dim, value_dim, dtype=torch.float32) if has_initial_state else None
    has_exports = d_exported is not None and d_exported.shape[0] > 0
    dummy = dv2
    block_v, stages = _launch_shape(value_dim, qg.dtype, num_sequences * heads, qg.device, block_v, "reverse")
    grid = (triton.cdiv(value_dim, block_v), num_sequences * heads)
    if grid[1] == 0:
        return dh, dh0, dv2
    _scan_backward_kernel[grid](
        qg, kg, w, gk,
        d_final if d_final is not None else dummy,
        dh0 if dh0 is not None else dummy,
        d_exported if has_exports else dummy,
        do, dh, dv, dv2,
        chunk_export if has_exports else cu_seqlens,
        final_export if has_exports else cu_seqlens,
        cu_seqlens, chunk_offsets, float(scale),
        H=heads, K=key_dim, V=value_dim, BT=chunk_size, BK=max(16, _next_power_of_2(key_dim)), BV=block_v,
        USE_INITIAL_STATE=has_initial_state, USE_FINAL_GRADIENT=d_final is not None, HAS_EXPORTS=has_exports,
        WHILE_LOOP=interpreter_enabled(),
        num_warps=num_warps, num_stages=stages if num_stages is None else num_stages,
    )
    return dh, dh0, dv2


def scan_reference(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    gk: torch.Tensor,
    initial_state: torch.Tensor | None,
    bounds: list[int],
    chunk_size: int,
    export_requests: list[tuple[int, int]],
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch forward scan, differentiable, in the inputs' dtype (the kernels' test oracle).

    ``export_requests``: (sequence, chunks) pairs, the state after that many chunks.
    Returns (chunk-start states per global chunk, v_new [T, H, V], final [N, H, K, V], exported [E, H, K, V]).
    """
    heads, key_dim, value_dim = kg.shape[1], kg.shape[2], u.shape[-1]
    starts, finals, boundary = [], [], {}
    v_new = torch.zeros_like(u)
    for sequence in range(len(bounds) - 1):
        begin, end = bounds[sequence], bounds[sequence + 1]
        state = (initial_state[sequence].to(kg.dtype) if initial_state is not None
                 else kg.new_zeros(heads, key_dim, value_dim))
        chunks = 0
        for lo in range(begin, end, chunk_size):
            hi = min(lo + chunk_size, end)
            boundary[(sequence, chunks)] = state
            starts.append(state)
            written = u[lo:hi] - torch.einsum("thk,hkv->thv", w[lo:hi], state)
            v_new = torch.cat([v_new[:lo], written, v_new[hi:]])
            decay = torch.exp2(gk[hi - 1]).unsqueeze(-1)  # [H, K, 1]
            state = state * decay + torch.einsum("thk,thv->hkv", kg[lo:hi], written)
            chunks += 1
        boundary[(sequence, chunks)] = state
        finals.append(state)
    final = torch.stack(finals) if finals else kg.new_zeros(0, heads, key_dim, value_dim)
    exported = (torch.stack([boundary[request] for request in export_requests]) if export_requests
                else kg.new_zeros(0, heads, key_dim, value_dim))
    return starts, v_new, final, exported
