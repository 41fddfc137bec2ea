"""Cross-chunk state scan of the chunkwise gated delta rule, as one Triton launch each way.

The intra-chunk (WY / UT) quantities of every chunk are computed beforehand with batched
torch ops (:mod:`harts.kernels.chunk_fast`). For chunk c of one sequence and one head, with
``B`` rows, key dim ``K`` and value dim ``V``, they are::

    W     [B, K]   state weights      U0   [B, V]   state-free written values
    Kend  [B, K]   keys decayed to the chunk end
    gamma [K]      decay of the whole chunk (exp of the chunk's total log decay)

and the scan runs, from the sequence's initial state ``S`` [K, V]::

    h_c  = S                                  (the state at the chunk's start)
    U_c  = U0_c - W_c S                       (the values the chunk actually writes, "v_new")
    S    = Diag(gamma_c) S + Kend_c^T U_c     (the state at the chunk's end)

One program owns one (sequence, head, block of V columns) and keeps its fp32 state in
registers while it walks the sequence's chunks. It writes every state the sequence passes
through into one ``states`` tensor of ``num_chunks + num_sequences`` slots: sequence i owns
the ``n_i + 1`` consecutive slots starting at ``state_base[i] = chunk_base[i] + i`` (the
start of each of its chunks, then its final state). Outputs read the chunk-start states,
the final state and the requested exported boundary states are gathers from this one
tensor, so exporting a boundary state costs no second scan (paper Eq. 16).

Backward is one reverse launch over the same grid. It takes the gradient of every slot of
``states`` (the output path's gradient of each chunk-start state plus, at exported slots
and final slots, whatever the consumers of those states sent back) and the gradient of
``U``, carries ``dS`` backwards through the chunks and returns the gradients of ``W``,
``U0``, ``Kend``, ``gamma`` and the initial states. Column blocks of V contribute partial
sums to the gradients of ``W``, ``Kend`` and ``gamma`` (they reduce over V); those partials
are written per block and summed afterwards, which keeps the result deterministic.

Bounds: chunk size <= 64 and K, V <= 256 (one chunk's W/Kend tiles and a [K, V-block] state
have to fit a program's registers). Everything inside runs in fp32; the matrix products use
``tl.dot`` with ``input_precision`` from ``HARTS_SCAN_PRECISION``: "tf32x3" by default (three
tf32 tensor-core products per fp32 product, accurate to about fp32 rounding; measured on an
H200 at K = V = 128, 16 heads, 16k rows: forward + backward of the whole KDA call 75 ms
against 164 ms with "ieee"), "ieee" (plain fp32 FMA) or "tf32" (one tf32 product, ~1e-3).

Triton is optional: without it this module still imports (``TRITON_AVAILABLE`` is False)
and calling the scan raises ``RuntimeError``. On CPU the kernels run under the Triton
interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which is how the tests
hold them to the reference without a GPU.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is an optional dependency: CI has neither Triton nor a GPU.
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
    TRITON_AVAILABLE = False

__all__ = [
    "MAX_CHUNK_SIZE",
    "MAX_HEAD_DIM",
    "TRITON_AVAILABLE",
    "ScanLayout",
    "interpreter_enabled",
    "state_scan",
]

MAX_CHUNK_SIZE = 64
MAX_HEAD_DIM = 256
_PRECISIONS = ("ieee", "tf32x3", "tf32")


def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dot_precision() -> str:
    precision = os.environ.get("HARTS_SCAN_PRECISION", "tf32x3")
    if precision not in _PRECISIONS:
        raise ValueError(f"HARTS_SCAN_PRECISION must be one of {_PRECISIONS}, got {precision!r}")
    return precision


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class ScanLayout:
    """Where each sequence's chunks and states live in the flat chunk / state-slot axes.

    Args:
        chunk_base: [N] index of each sequence's first chunk (int32 on the kernels' device).
        chunk_count: [N] number of chunks of each sequence.
        num_chunks: total chunks (sum of chunk_count).
    """

    def __init__(self, chunk_base: torch.Tensor, chunk_count: torch.Tensor, num_chunks: int):
        self.chunk_base = chunk_base.to(torch.int32).contiguous()
        self.chunk_count = chunk_count.to(torch.int32).contiguous()
        self.num_sequences = int(chunk_base.numel())
        self.num_chunks = int(num_chunks)
        self.num_slots = self.num_chunks + self.num_sequences


if TRITON_AVAILABLE:

    @triton.jit
    def _fwd_step(
        state, chunk, slot, w_ptr, u0_ptr, kend_ptr, gamma_ptr, states_ptr, u_ptr, head, H, B, K, V,
        keys, key_ok, state_offsets, state_mask, rk_offsets, rk_mask, rv_offsets, rv_mask,
        PRECISION: tl.constexpr,
    ):
        tl.store(states_ptr + (slot * H + head) * K * V + state_offsets, state, mask=state_mask)
        row_base = (chunk * H + head) * B
        w = tl.load(w_ptr + row_base * K + rk_offsets, mask=rk_mask, other=0.0)
        u0 = tl.load(u0_ptr + row_base * V + rv_offsets, mask=rv_mask, other=0.0)
        u = u0 - tl.dot(w, state, input_precision=PRECISION)
        tl.store(u_ptr + row_base * V + rv_offsets, u, mask=rv_mask)
        kend = tl.load(kend_ptr + row_base * K + rk_offsets, mask=rk_mask, other=0.0)
        gamma = tl.load(gamma_ptr + (chunk * H + head) * K + keys, mask=key_ok, other=0.0)
        return state * gamma[:, None] + tl.dot(tl.trans(kend), u, input_precision=PRECISION)

    @triton.jit
    def _state_scan_fwd_kernel(
        w_ptr,  # [NT, H, B, K]
        u0_ptr,  # [NT, H, B, V]
        kend_ptr,  # [NT, H, B, K]
        gamma_ptr,  # [NT, H, K]
        init_ptr,  # [N, H, K, V] (read only when HAS_INIT)
        states_ptr,  # [NT + N, H, K, V] out
        u_ptr,  # [NT, H, B, V] out
        chunk_base_ptr,  # [N] int32
        chunk_count_ptr,  # [N] int32
        H,
        B,
        K,
        V,
        HAS_INIT: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_sh = tl.program_id(0)
        pid_v = tl.program_id(1)
        seq = pid_sh // H
        head = pid_sh % H
        base = tl.load(chunk_base_ptr + seq).to(tl.int64)
        count = tl.load(chunk_count_ptr + seq)
        state_base = base + seq

        rows = tl.arange(0, BT)
        keys = tl.arange(0, BK)
        cols = pid_v * BV + tl.arange(0, BV)
        row_ok = rows < B
        key_ok = keys < K
        col_ok = cols < V
        state_mask = key_ok[:, None] & col_ok[None, :]
        state_offsets = keys[:, None] * V + cols[None, :]
        rk_mask = row_ok[:, None] & key_ok[None, :]
        rv_mask = row_ok[:, None] & col_ok[None, :]
        rk_offsets = rows[:, None] * K + keys[None, :]
        rv_offsets = rows[:, None] * V + cols[None, :]

        if HAS_INIT:
            init_base = (seq.to(tl.int64) * H + head) * K * V
            state = tl.load(init_ptr + init_base + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BK, BV], dtype=tl.float32)

        # The interpreter cannot take a loaded scalar as a range() bound; compiled code wants
        # range() so that the next chunk's loads are pipelined.
        if WHILE_LOOP:
            c = count * 0
            while c < count:
                state = _fwd_step(
                    state, base + c, state_base + c, w_ptr, u0_ptr, kend_ptr, gamma_ptr, states_ptr, u_ptr,
                    head, H, B, K, V, keys, key_ok, state_offsets, state_mask, rk_offsets, rk_mask, rv_offsets,
                    rv_mask, PRECISION,
                )
                c += 1
        else:
            for c in range(count):
                state = _fwd_step(
                    state, base + c, state_base + c, w_ptr, u0_ptr, kend_ptr, gamma_ptr, states_ptr, u_ptr,
                    head, H, B, K, V, keys, key_ok, state_offsets, state_mask, rk_offsets, rk_mask, rv_offsets,
                    rv_mask, PRECISION,
                )

        final_slot = state_base + count
        tl.store(states_ptr + (final_slot * H + head) * K * V + state_offsets, state, mask=state_mask)

    @triton.jit
    def _bwd_step(
        d_state, chunk, slot, w_ptr, kend_ptr, gamma_ptr, states_ptr, u_ptr, dstates_ptr, du_ptr, du0_ptr,
        dw_ptr, dkend_ptr, dgamma_ptr, partial_base, head, H, B, K, V,
        keys, key_ok, state_offsets, state_mask, rk_offsets, rk_mask, rv_offsets, rv_mask,
        PRECISION: tl.constexpr,
    ):
        row_base = (chunk * H + head) * B
        state = tl.load(states_ptr + (slot * H + head) * K * V + state_offsets, mask=state_mask, other=0.0)
        u = tl.load(u_ptr + row_base * V + rv_offsets, mask=rv_mask, other=0.0)
        du = tl.load(du_ptr + row_base * V + rv_offsets, mask=rv_mask, other=0.0).to(tl.float32)
        kend = tl.load(kend_ptr + row_base * K + rk_offsets, mask=rk_mask, other=0.0)
        w = tl.load(w_ptr + row_base * K + rk_offsets, mask=rk_mask, other=0.0)
        gamma = tl.load(gamma_ptr + (chunk * H + head) * K + keys, mask=key_ok, other=0.0)

        # U feeds the chunk's end state through Kend^T U, so its total gradient adds Kend dS.
        du_total = du + tl.dot(kend, d_state, input_precision=PRECISION)
        tl.store(du0_ptr + row_base * V + rv_offsets, du_total, mask=rv_mask)
        d_kend = tl.dot(u, tl.trans(d_state), input_precision=PRECISION)
        d_w = -tl.dot(du_total, tl.trans(state), input_precision=PRECISION)
        d_gamma = tl.sum(state * d_state, axis=1)
        partial_rows = ((partial_base + chunk) * H + head) * B
        tl.store(dkend_ptr + partial_rows * K + rk_offsets, d_kend, mask=rk_mask)
        tl.store(dw_ptr + partial_rows * K + rk_offsets, d_w, mask=rk_mask)
        tl.store(dgamma_ptr + ((partial_base + chunk) * H + head) * K + keys, d_gamma, mask=key_ok)
        incoming = tl.load(dstates_ptr + (slot * H + head) * K * V + state_offsets, mask=state_mask, other=0.0)
        return d_state * gamma[:, None] - tl.dot(tl.trans(w), du_total, input_precision=PRECISION) + incoming.to(
            tl.float32
        )

    @triton.jit
    def _state_scan_bwd_kernel(
        w_ptr,  # [NT, H, B, K]
        kend_ptr,  # [NT, H, B, K]
        gamma_ptr,  # [NT, H, K]
        states_ptr,  # [NT + N, H, K, V] saved forward states
        u_ptr,  # [NT, H, B, V] saved forward U
        dstates_ptr,  # [NT + N, H, K, V] incoming gradient of every state slot
        du_ptr,  # [NT, H, B, V] incoming gradient of U
        du0_ptr,  # [NT, H, B, V] out
        dw_ptr,  # [NV, NT, H, B, K] out (partial over V blocks)
        dkend_ptr,  # [NV, NT, H, B, K] out (partial)
        dgamma_ptr,  # [NV, NT, H, K] out (partial)
        dinit_ptr,  # [N, H, K, V] out
        chunk_base_ptr,
        chunk_count_ptr,
        H,
        B,
        K,
        V,
        NT,
        WHILE_LOOP: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_sh = tl.program_id(0)
        pid_v = tl.program_id(1)
        seq = pid_sh // H
        head = pid_sh % H
        base = tl.load(chunk_base_ptr + seq).to(tl.int64)
        count = tl.load(chunk_count_ptr + seq)
        state_base = base + seq

        rows = tl.arange(0, BT)
        keys = tl.arange(0, BK)
        cols = pid_v * BV + tl.arange(0, BV)
        row_ok = rows < B
        key_ok = keys < K
        col_ok = cols < V
        state_mask = key_ok[:, None] & col_ok[None, :]
        state_offsets = keys[:, None] * V + cols[None, :]
        rk_mask = row_ok[:, None] & key_ok[None, :]
        rv_mask = row_ok[:, None] & col_ok[None, :]
        rk_offsets = rows[:, None] * K + keys[None, :]
        rv_offsets = rows[:, None] * V + cols[None, :]
        partial_base = pid_v.to(tl.int64) * NT

        final_slot = state_base + count
        d_state = tl.load(
            dstates_ptr + (final_slot * H + head) * K * V + state_offsets, mask=state_mask, other=0.0
        ).to(tl.float32)

        if WHILE_LOOP:
            c = count - 1
            while c >= 0:
                d_state = _bwd_step(
                    d_state, base + c, state_base + c, w_ptr, kend_ptr, gamma_ptr, states_ptr, u_ptr, dstates_ptr,
                    du_ptr, du0_ptr, dw_ptr, dkend_ptr, dgamma_ptr, partial_base, head, H, B, K, V, keys, key_ok,
                    state_offsets, state_mask, rk_offsets, rk_mask, rv_offsets, rv_mask, PRECISION,
                )
                c -= 1
        else:
            for i in range(count):
                c = count - 1 - i
                d_state = _bwd_step(
                    d_state, base + c, state_base + c, w_ptr, kend_ptr, gamma_ptr, states_ptr, u_ptr, dstates_ptr,
                    du_ptr, du0_ptr, dw_ptr, dkend_ptr, dgamma_ptr, partial_base, head, H, B, K, V, keys, key_ok,
                    state_offsets, state_mask, rk_offsets, rk_mask, rv_offsets, rv_mask, PRECISION,
                )

        init_base = (seq.to(tl.int64) * H + head) * K * V
        tl.store(dinit_ptr + init_base + state_offsets, d_state, mask=state_mask)


def _tiles(chunk_size: int, key_dim: int, value_dim: int, state_elements: int) -> tuple[int, int, int, int]:
    """Register tile sizes (rows, keys, value block) and the number of value blocks.

    ``state_elements`` bounds the [K, V-block] fp32 tile a program keeps in registers."""
    block_rows = max(16, _next_power_of_2(chunk_size))  # tl.dot needs every dim >= 16
    block_keys = max(16, _next_power_of_2(key_dim))
    block_values = max(16, min(_next_power_of_2(value_dim), state_elements // block_keys))
    return block_rows, block_keys, block_values, -(-value_dim // block_values)


_working_stages: dict[tuple, int] = {}


def _launch(kernel, grid, args, config: dict) -> None:
    """Launch with the deepest software pipelining (3, 2, 1 stages) that fits in shared memory.

    The staged tiles grow with K, V and the chunk size; the depth that fits is found once per
    tile configuration and remembered."""
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else id(kernel), tuple(sorted(config.items())))
    for stages in ([_working_stages[key]] if key in _working_stages else [3, 2, 1]):
        try:
            kernel[grid](*args, **config, num_stages=stages)
        except OutOfResources:
            if stages == 1:
                raise
            continue
        _working_stages[key] = stages
        return


def _check_runnable(device: torch.device) -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("the fast linear-attention state scan needs Triton, which is not installed")
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"the Triton state scan got tensors on {device}; run it on CUDA, or on CPU under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before triton is imported)"
        )


def _num_warps(block_keys: int, block_values: int) -> int:
    return 8 if block_keys * block_values >= 8192 else 4


# the forward keeps one [K, V-block] state in registers, the backward a state and its gradient
_FORWARD_STATE_ELEMENTS = 8192
_BACKWARD_STATE_ELEMENTS = 4096


def _scan_forward(w, u0, kend, gamma, initial, layout: ScanLayout):
    num_chunks, heads, chunk_size, key_dim = w.shape
    value_dim = u0.shape[-1]
    block_rows, block_keys, block_values, value_blocks = _tiles(chunk_size, key_dim, value_dim, _FORWARD_STATE_ELEMENTS)
    states = torch.empty(layout.num_slots, heads, key_dim, value_dim, device=w.device, dtype=torch.float32)
    u = torch.empty_like(u0)
    if layout.num_sequences == 0:
        return states, u
    grid = (layout.num_sequences * heads, value_blocks)
    _launch(
        _state_scan_fwd_kernel,
        grid,
        (
            w, u0, kend, gamma, initial if initial is not None else states, states, u,
            layout.chunk_base, layout.chunk_count, heads, chunk_size, key_dim, value_dim,
        ),
        dict(
            HAS_INIT=initial is not None,
            WHILE_LOOP=interpreter_enabled(),
            BT=block_rows,
            BK=block_keys,
            BV=block_values,
            PRECISION=_dot_precision(),
            num_warps=_num_warps(block_keys, block_values),
        ),
    )
    return states, u


def _scan_backward(w, kend, gamma, states, u, d_states, d_u, layout: ScanLayout):
    num_chunks, heads, chunk_size, key_dim = w.shape
    value_dim = u.shape[-1]
    block_rows, block_keys, block_values, value_blocks = _tiles(chunk_size, key_dim, value_dim, _BACKWARD_STATE_ELEMENTS)
    device = w.device
    d_u0 = torch.empty_like(u)
    d_w = torch.empty(value_blocks, *w.shape, device=device, dtype=torch.float32)
    d_kend = torch.empty(value_blocks, *kend.shape, device=device, dtype=torch.float32)
    d_gamma = torch.empty(value_blocks, *gamma.shape, device=device, dtype=torch.float32)
    d_initial = torch.empty(layout.num_sequences, heads, key_dim, value_dim, device=device, dtype=torch.float32)
    if layout.num_sequences:
        grid = (layout.num_sequences * heads, value_blocks)
        _launch(
            _state_scan_bwd_kernel,
            grid,
            (
                w, kend, gamma, states, u, d_states, d_u, d_u0, d_w, d_kend, d_gamma, d_initial,
                layout.chunk_base, layout.chunk_count, heads, chunk_size, key_dim, value_dim, num_chunks,
            ),
            dict(
                WHILE_LOOP=interpreter_enabled(),
                BT=block_rows,
                BK=block_keys,
                BV=block_values,
                PRECISION=_dot_precision(),
                num_warps=_num_warps(block_keys, block_values),
            ),
        )
    if value_blocks == 1:
        return d_u0, d_w[0], d_kend[0], d_gamma[0], d_initial
    return d_u0, d_w.sum(0), d_kend.sum(0), d_gamma.sum(0), d_initial


class _StateScan(torch.autograd.Function):
    """(W, U0, Kend, gamma, initial) -> (states [NT+N, H, K, V], U [NT, H, B, V]); see the module docstring."""

    @staticmethod
    def forward(ctx, w, u0, kend, gamma, initial, layout):
        w, u0, kend, gamma = (t.contiguous() for t in (w, u0, kend, gamma))
        if initial is not None:
            initial = initial.contiguous()
        states, u = _scan_forward(w, u0, kend, gamma, initial, layout)
        ctx.save_for_backward(w, kend, gamma, states, u)
        ctx.layout = layout
        ctx.has_initial = initial is not None
        return states, u

    @staticmethod
    def backward(ctx, d_states, d_u):
        w, kend, gamma, states, u = ctx.saved_tensors
        d_u0, d_w, d_kend, d_gamma, d_initial = _scan_backward(
            w, kend, gamma, states, u, d_states.float().contiguous(), d_u.float().contiguous(), ctx.layout
        )
        return d_w, d_u0, d_kend, d_gamma, (d_initial if ctx.has_initial else None), None


def state_scan(
    w: torch.Tensor,
    u0: torch.Tensor,
    kend: torch.Tensor,
    gamma: torch.Tensor,
    initial: torch.Tensor | None,
    layout: ScanLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the cross-chunk scan (differentiable w.r.t. every tensor argument).

    Args:
        w, kend: [NT, H, B, K] fp32; u0: [NT, H, B, V] fp32; gamma: [NT, H, K] fp32.
        initial: None (zero states) or [N, H, K, V].
        layout: chunk ranges of the N sequences.
    Returns:
        states [NT + N, H, K, V] fp32 (slot ``state_base[i] + c`` is sequence i's state after
        c of its chunks) and U [NT, H, B, V] fp32.
    """
    _check_runnable(w.device)
    num_chunks, heads, chunk_size, key_dim = w.shape
    value_dim = u0.shape[-1]
    if chunk_size > MAX_CHUNK_SIZE or key_dim > MAX_HEAD_DIM or value_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"the state scan supports chunk size <= {MAX_CHUNK_SIZE} and head dims <= {MAX_HEAD_DIM}; "
            f"got chunk size {chunk_size}, K {key_dim}, V {value_dim}"
        )
    if num_chunks != layout.num_chunks:
        raise ValueError(f"state_scan: W has {num_chunks} chunks but the layout counts {layout.num_chunks}")
    tensors = [w.float(), u0.float(), kend.float(), gamma.float()]
    if initial is not None:
        initial = initial.float()
    return _StateScan.apply(*tensors, initial, layout)
