"""Lower one microbatch's execution schedule to torch.fx programs, one per operator kind.

The programs are the compiler's executable output: every layer of a kind runs the same
program with its own tensors (the runtime's :class:`~harts.runtime.tree_view.TreeView`
builds them once per layout, device and kernel set, :mod:`harts.runtime.programs`, and
calls them), and their code prints with the ``codegen`` stage of an IR dump
(:func:`render_programs`).

* linear attention ``(q, k, v, log_decay, beta, scale) -> o``: per round one gather of the
  round's rows (replay rows are ancestors' existing rows), one packed chunkwise call, the
  state handoffs (exported boundary states become later rounds' initial states, inside
  the autograd graph) and the selection of non-replay outputs, which fill the compact row
  order, round-major by construction. The gathers and the selection are modules of
  :mod:`harts.kernels.rows.packed`, whose backward writes each row's gradient once.
* causal convolution ``(x, weight, bias, activation) -> y``: one packed call over the
  sequences' own rows, each preceded by its true ancestors' last ``w - 1`` rows.
* the same two on the linear-attention layers' packed rows (:func:`linear_rows`: every round's
  replay and own rows, rounds back to back), which such a layer gathers its hidden rows into
  once: the rounds are slices, and the convolution's sequences are the packed ones.
* attention ``(q, k, v, scale) -> o``: compact queries per sequence (already contiguous in
  the layout) against a gathered ancestor + own key/value view, bottom-right causal; or, as
  ``cascade_attention``, split at the forks (:mod:`harts.kernels.attention.cascade`): each
  sequence's own rows in place, each shared ancestor run once per fork, merged by log-sum-exp.
* log-probs ``(hidden, input_ids, weight, bias) -> (log_probs, entropy)``: one vocabulary
  pass per compact row, then one target lookup per semantic position (Eq. 17-19).

Index lists are registered as buffers, so ``program.to(device)`` moves them.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
import torch.fx

from harts.ir.layout import MicrobatchLayout
from harts.kernels import dispatch, host
from harts.kernels.attention.cascade import CascadeAttention
from harts.kernels.rows.packed import RowGather, RowScatter, contiguous_span
from harts.numerics import compact_log_probs

#: The kinds of program a layout lowers to (one per sequence operator, plus log-probs).
PROGRAM_KINDS = ("linear_attention", "conv", "attention", "log_probs", "packed_linear_attention", "packed_conv",
                 "cascade_attention")


def default_kernels():
    """The kernel dispatch: fast kernels for CUDA inputs when Triton is present, else the references."""
    return dispatch


class _ProgramBuilder:
    """A torch.fx graph plus the buffers its ``get_attr`` nodes read."""

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()

    def buffer(self, name: str, values: np.ndarray | list[int]) -> torch.fx.Node:
        self.root.register_buffer(name, torch.tensor(np.asarray(values, dtype=np.int64)))
        return self.graph.get_attr(name)

    def call(self, target, args: tuple, kwargs: dict | None = None, name: str | None = None) -> torch.fx.Node:
        return self.graph.create_node("call_function", target, args, kwargs or {}, name=name)

    def submodule(self, name: str, module: torch.nn.Module) -> str:
        """Attach ``module`` (index buffers and all) to the program; ``call_module`` nodes name it."""
        self.root.add_module(name, module)
        return name

    def call_module(self, target: str, args: tuple, name: str | None = None) -> torch.fx.Node:
        return self.graph.create_node("call_module", target, args, {}, name=name)

    def finish(self, outputs: Any, class_name: str) -> torch.fx.GraphModule:
        self.graph.output(outputs)
        self.graph.lint()
        return torch.fx.GraphModule(self.root, self.graph, class_name=class_name)


def round_schedule(layout: MicrobatchLayout, round_index: int) -> dict[str, Any]:
    """Index lists of one linear-attention round: packed rows, spans, kept outputs, states, exports."""
    first, last = int(layout.round_seq_start[round_index]), int(layout.round_seq_start[round_index + 1])
    gathered, lengths, keep, export_chunks = [], [], [], []
    packed = 0
    for sequence in range(first, last):
        replay = layout.replay_rows(sequence)
        own = layout.sequence_rows(sequence)
        gathered.extend((replay, own))
        lengths.append(replay.size + own.size)
        keep.append(np.arange(packed + replay.size, packed + replay.size + own.size, dtype=np.int64))
        packed += replay.size + own.size
        chunks = layout.export_chunk[layout.export_offsets[sequence] : layout.export_offsets[sequence + 1]]
        export_chunks.append([int(c) for c in chunks])
    rows = np.concatenate(gathered) if gathered else np.zeros(0, dtype=np.int64)
    cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu_seqlens[1:])
    return {
        "sequences": range(first, last),
        "rows": rows,
        "cu_seqlens": cu_seqlens,
        "keep": np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64),
        "replay": packed != int(layout.seq_row_start[last] - layout.seq_row_start[first]),
        "export_chunks": export_chunks if any(export_chunks) else None,
        "state_export": layout.seq_state_export[first:last],
    }


def _round_calls(b: _ProgramBuilder, layout: MicrobatchLayout, schedules: list[dict[str, Any]], round_inputs,
                 scale: torch.fx.Node, kernels) -> list[torch.fx.Node]:
    """One chunkwise call per round on ``round_inputs(r)`` (its packed q, k, v, decay, beta), with the state
    handoffs: exported boundary states become later rounds' initial states, inside the autograd graph.
    Returns the rounds' packed outputs."""
    export_round = layout.seq_round[layout.export_sequence()]
    exported_by_round: dict[int, torch.fx.Node] = {}
    outputs = []
    for r, schedule in enumerate(schedules):
        packed = round_inputs(r)
        cu_seqlens = b.buffer(f"round{r}_cu_seqlens", schedule["cu_seqlens"])

        initial_state = None
        sources = schedule["state_export"]
        if np.any(sources >= 0):
            producer_rounds = sorted({int(export_round[e]) for e in sources if e >= 0})
            parts, base = [], {}
            offset = 0
            if np.any(sources < 0):
                first_part = exported_by_round[producer_rounds[0]]
                one = b.call(operator.getitem, (first_part, slice(0, 1)), name=f"one_state_round{r}")
                parts.append(b.call(torch.zeros_like, (one,), name=f"zero_state_round{r}"))
                offset = 1
            for producer in producer_rounds:
                first_export = int(layout.export_offsets[layout.round_seq_start[producer]])
                base[producer] = offset - first_export
                offset += int(layout.export_offsets[layout.round_seq_start[producer + 1]]) - first_export
                parts.append(exported_by_round[producer])
            state_index = [0 if e < 0 else int(e) + base[int(export_round[e])] for e in sources]
            bank = parts[0] if len(parts) == 1 else b.call(torch.cat, (parts, 0), name=f"state_bank_round{r}")
            if state_index == list(range(offset)):
                initial_state = bank
            else:
                initial_state = b.call(
                    torch.index_select, (bank, 0, b.buffer(f"round{r}_state_index", state_index)), name=f"initial_state_round{r}"
                )

        call = b.call(
            kernels.chunk_linear_attention,
            (packed["q"], packed["k"], packed["v"], packed["log_decay"], packed["beta"], cu_seqlens),
            {"chunk_size": layout.chunk_size, "scale": scale, "initial_state": initial_state, "export_chunks": schedule["export_chunks"]},
            name=f"call_round{r}",
        )
        outputs.append(b.call(operator.getitem, (call, 0), name=f"o_round{r}"))
        if schedule["export_chunks"] is not None:
            exported_by_round[r] = b.call(operator.getitem, (call, 2), name=f"exported_round{r}")
    return outputs


_LINEAR_INPUTS = ("q", "k", "v", "log_decay", "beta")


def build_linear_attention_program(layout: MicrobatchLayout, kernels=None) -> torch.fx.GraphModule:
    """One packed chunkwise call per round on the compact rows, with gathers, state handoffs and output selection.

    The rounds' packed inputs come from one :class:`~harts.kernels.rows.packed.RowGather` per
    program (shared by q, k, v, decay and beta) and their outputs go back through one
    :class:`~harts.kernels.rows.packed.RowScatter`, so each compact row's gradient is written
    once rather than summed over full-size zero-padded gradients of every round.
    """
    kernels = kernels or default_kernels()
    b = _ProgramBuilder()
    inputs = {name: b.graph.placeholder(name) for name in _LINEAR_INPUTS}
    scale = b.graph.placeholder("scale")
    schedules = [round_schedule(layout, r) for r in range(layout.num_rounds)]
    pack = b.submodule("pack_rounds", RowGather(layout.num_rows, [schedule["rows"] for schedule in schedules]))
    packed_rounds = {name: b.call_module(pack, (node,), name=f"{name}_rounds") for name, node in inputs.items()}

    def round_inputs(r: int) -> dict[str, torch.fx.Node]:
        return {name: b.call(operator.getitem, (node, r), name=f"{name}_round{r}") for name, node in packed_rounds.items()}

    outputs = _round_calls(b, layout, schedules, round_inputs, scale, kernels)
    # round-major compact order: round r's own rows are the next block of rows
    starts = layout.seq_row_start[layout.round_seq_start]
    unpack = b.submodule("unpack_rounds", RowScatter(
        layout.num_rows,
        [np.arange(starts[r], starts[r + 1]) for r in range(layout.num_rounds)],
        [schedule["keep"] for schedule in schedules],
        [schedule["rows"].size for schedule in schedules],
    ))
    return b.finish(b.call_module(unpack, tuple(outputs), name="o"), "LinearAttentionRounds")


def linear_rows(layout: MicrobatchLayout) -> dict[str, np.ndarray]:
    """The rows the linear-attention layers run on: every round's packed input, rounds back to back.

    A round packs each of its sequences as its replay rows (an ancestor's last rows, re-read from the
    chunk boundary its initial state sits on) followed by its own rows; with no replay anywhere these
    are the compact rows in their own order. A layer that gathers its hidden rows into this order once
    (3 KB a row on the headline model) runs projections, convolution and the chunkwise calls on it, the
    rounds being slices, instead of gathering every round's q, k, v, decay and beta (20 KB a row) and
    scattering their outputs back; the replay rows' projections are computed twice, the price of that.

    Returns ``rows`` [P] (the compact row of each packed row), ``round_bounds`` [rounds + 1] and
    ``sequence_bounds`` [Q + 1] (packed offsets), ``own`` [C] (the packed row where each compact row is
    one of its sequence's own rows) and ``has_replay`` (whether P > C; if not, ``rows`` is ``0 .. C - 1``).
    """
    return _packed_rows(layout, [round_schedule(layout, r) for r in range(layout.num_rounds)])


def _packed_rows(layout: MicrobatchLayout, schedules: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """:func:`linear_rows` from the layout's round schedules."""
    sizes = [schedule["rows"].size for schedule in schedules]
    round_bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=round_bounds[1:])
    starts = layout.seq_row_start[layout.round_seq_start]
    own = np.empty(layout.num_rows, dtype=np.int64)
    sequence_bounds = [np.zeros(1, dtype=np.int64)]
    for r, schedule in enumerate(schedules):
        own[starts[r] : starts[r + 1]] = round_bounds[r] + schedule["keep"]
        sequence_bounds.append(round_bounds[r] + schedule["cu_seqlens"][1:])
    rows = np.concatenate([schedule["rows"] for schedule in schedules]) if schedules else np.zeros(0, dtype=np.int64)
    return {
        "rows": rows,
        "round_bounds": round_bounds,
        "sequence_bounds": np.concatenate(sequence_bounds),
        "own": own,
        "has_replay": bool(rows.size != layout.num_rows),
    }


def build_packed_linear_attention_program(layout: MicrobatchLayout, kernels=None) -> torch.fx.GraphModule:
    """The chunkwise rounds on :func:`linear_rows`' packed rows: each round's inputs are a slice, its output the
    same slice of the result (replay positions included)."""
    kernels = kernels or default_kernels()
    b = _ProgramBuilder()
    inputs = {name: b.graph.placeholder(name) for name in _LINEAR_INPUTS}
    scale = b.graph.placeholder("scale")
    schedules = [round_schedule(layout, r) for r in range(layout.num_rounds)]
    bounds = _packed_rows(layout, schedules)["round_bounds"]

    def round_inputs(r: int) -> dict[str, torch.fx.Node]:
        start, length = int(bounds[r]), int(bounds[r + 1] - bounds[r])
        return {name: b.call(torch.narrow, (node, 0, start, length), name=f"{name}_round{r}") for name, node in inputs.items()}

    outputs = _round_calls(b, layout, schedules, round_inputs, scale, kernels)
    o = outputs[0] if len(outputs) == 1 else b.call(torch.cat, (outputs, 0), name="o")
    return b.finish(o, "PackedLinearAttentionRounds")


def _zero_padded(values: torch.Tensor, slots: torch.Tensor, total: int) -> torch.Tensor:
    """[total, ...] zeros with ``values`` in rows ``slots`` (differentiable in ``values``)."""
    return values.new_zeros((total, *values.shape[1:])).index_copy(0, slots, values)


def conv_context_rows(layout: MicrobatchLayout, width: int, before_replay: bool = False) -> np.ndarray:
    """[Q, width-1] rows of each sequence's last ``width - 1`` true-ancestor positions (-1 before position 0);
    with ``before_replay``, the last ones before its replay start (what precedes its packed rows)."""
    context = np.full((layout.num_sequences, max(width - 1, 0)), -1, dtype=np.int64)
    if width <= 1:
        return context
    for sequence in range(layout.num_sequences):
        ancestors = layout.ancestor_rows_of(sequence)
        if before_replay:
            ancestors = ancestors[: int(layout.seq_replay_start[sequence])]
        ancestors = ancestors[-(width - 1) :]
        if ancestors.size:
            context[sequence, width - 1 - ancestors.size :] = ancestors
    return context


def packed_conv_context_rows(layout: MicrobatchLayout, width: int, own: np.ndarray) -> np.ndarray:
    """[Q, width-1] packed rows (:func:`linear_rows`) of the ``width - 1`` true-ancestor positions before each
    sequence's packed rows (its replay start), each at ``own[row]``, the packed row that computes it as its own
    (-1 before position 0)."""
    context = conv_context_rows(layout, width, before_replay=True)
    present = context >= 0
    context[present] = own[context[present]]
    return context


def _conv_program(num_rows: int, bounds: np.ndarray, rows: np.ndarray, width: int, kernels, class_name: str
                  ) -> torch.fx.GraphModule:
    """Depthwise causal convolution over ``num_rows`` rows in sequences ``bounds``, sequence ``i`` preceded by
    the rows ``rows[i]`` of the same tensor (-1: zeros, before position 0)."""
    kernels = kernels or default_kernels()
    b = _ProgramBuilder()
    x = b.graph.placeholder("x")
    weight = b.graph.placeholder("weight")
    bias = b.graph.placeholder("bias")
    activation = b.graph.placeholder("activation", default_value="silu")
    cu_seqlens = b.buffer("cu_seqlens", bounds)
    context = None
    if width > 1 and np.any(rows >= 0):
        flat_rows = rows.reshape(-1)
        present = np.flatnonzero(flat_rows >= 0)
        gather = b.submodule("context_view", RowGather(num_rows, [flat_rows[present]]))
        flat = b.call(operator.getitem, (b.call_module(gather, (x,), name="context_views"), 0), name="context_rows")
        if present.size < flat_rows.size:  # windows reaching before position 0 read zeros there
            flat = b.call(_zero_padded, (flat, b.buffer("context_slots", present), int(flat_rows.size)), name="context_slots")
        context = b.call(torch.reshape, (flat, (rows.shape[0], width - 1, -1)), name="context")
    y = b.call(kernels.causal_conv1d, (x, weight, bias, cu_seqlens), {"context": context, "activation": activation}, name="y")
    return b.finish(y, class_name)


def build_conv_program(layout: MicrobatchLayout, width: int, kernels=None) -> torch.fx.GraphModule:
    """Depthwise causal convolution over each sequence's own rows with true-ancestor context."""
    return _conv_program(layout.num_rows, layout.seq_row_start, conv_context_rows(layout, width), width, kernels,
                         "CausalConvView")


def build_packed_conv_program(layout: MicrobatchLayout, width: int, kernels=None) -> torch.fx.GraphModule:
    """The convolution on :func:`linear_rows`' packed rows: each sequence's replay and own rows, preceded by the
    true ancestors before its replay start. A replay row's output equals its own row's (same window)."""
    packed = linear_rows(layout)
    return _conv_program(int(packed["rows"].size), packed["sequence_bounds"],
                         packed_conv_context_rows(layout, width, packed["own"]), width, kernels, "PackedCausalConvView")


def attention_kv_rows(layout: MicrobatchLayout) -> tuple[np.ndarray, np.ndarray]:
    """Rows of every sequence's key/value view (ancestors then own rows) and its offsets."""
    parts, lengths = [], []
    for sequence in range(layout.num_sequences):
        ancestors, own = layout.ancestor_rows_of(sequence), layout.sequence_rows(sequence)
        parts.extend((ancestors, own))
        lengths.append(ancestors.size + own.size)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), offsets


def build_attention_program(layout: MicrobatchLayout, kernels=None, *, split_at_forks: bool = False) -> torch.fx.GraphModule:
    """Compact queries against gathered ancestor + own keys/values, bottom-right causal.

    With ``split_at_forks`` (the ``cascade_attention`` program) the same attention runs split at the forks: own
    rows causal on the compact q, k, v, the ancestor runs non-causal, merged by log-sum-exp
    (:class:`CascadeAttention`). A layout whose sequences read only their own rows, or a kernel set without
    ``attention_forward``, gets the gathered program either way.
    """
    kernels = kernels or default_kernels()
    b = _ProgramBuilder()
    q = b.graph.placeholder("q")
    k = b.graph.placeholder("k")
    v = b.graph.placeholder("v")
    scale = b.graph.placeholder("scale")
    rows, kv_offsets = attention_kv_rows(layout)
    own_rows_only = contiguous_span(rows) == (0, layout.num_rows)  # every sequence reads only its own rows
    values = v
    if not own_rows_only and hasattr(kernels, "attention_values"):
        # a kernel that pads narrower values (MLA on FlashAttention) gets them padded on the compact rows,
        # once, rather than on every row of the gathered view (or of the cascade's gathered runs)
        values = b.call(kernels.attention_values, (q, k, v), name="kernel_values")
    if split_at_forks and not own_rows_only and hasattr(kernels, "attention_forward"):
        cascade = b.submodule("cascade", CascadeAttention(layout.num_rows, layout.seq_row_start, layout.ancestor_rows,
                                                          layout.ancestor_offsets, kernels))
        o = b.call_module(cascade, (q, k, values, scale), name="o")
        class_name = "CascadeAttentionView"
    else:
        k_view, v_view = k, v
        if not own_rows_only:
            view = b.submodule("kv_view", RowGather(layout.num_rows, [rows]))
            k_view = b.call(operator.getitem, (b.call_module(view, (k,), name="k_views"), 0), name="k_view")
            v_view = b.call(operator.getitem, (b.call_module(view, (values,), name="v_views"), 0), name="v_view")
        cu_q = b.buffer("cu_seqlens_q", layout.seq_row_start)
        cu_k = b.buffer("cu_seqlens_k", kv_offsets)
        o = b.call(kernels.attention, (q, k_view, v_view, cu_q, cu_k), {"scale": scale, "causal": True}, name="o")
        class_name = "AttentionView"
    if values is not v:
        o = b.call(_value_columns, (o, v), name="o_values")
    return b.finish(o, class_name)


def build_cascade_attention_program(layout: MicrobatchLayout, kernels=None) -> torch.fx.GraphModule:
    """:func:`build_attention_program` split at the forks."""
    return build_attention_program(layout, kernels, split_at_forks=True)


def _value_columns(o: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The first ``v.shape[-1]`` columns of an attention output computed with zero-padded values."""
    return o if o.shape[-1] == v.shape[-1] else o[..., : v.shape[-1]]


def log_prob_rows(layout: MicrobatchLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every non-final semantic position (member order, then position): its logit row,
    the row holding its next token, and per member the offsets into that list."""
    offsets = layout.trajectory_offsets
    keep = np.ones(layout.semantic_tokens, dtype=bool)
    keep[offsets[1:] - 1] = False  # the last position of a trajectory predicts nothing
    nxt = np.zeros(layout.semantic_tokens, dtype=bool)
    nxt[offsets[:-1]] = True
    rows = layout.trajectory_rows[keep]
    next_rows = layout.trajectory_rows[~nxt]
    counts = np.diff(offsets) - 1
    out_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out_offsets[1:])
    return rows, next_rows, out_offsets


def build_log_prob_program(layout: MicrobatchLayout) -> torch.fx.GraphModule:
    """Compact-to-semantic log-probs (Eq. 17-19) for every member trajectory, member-major."""
    b = _ProgramBuilder()
    hidden = b.graph.placeholder("hidden")
    input_ids = b.graph.placeholder("input_ids")
    weight = b.graph.placeholder("weight")
    bias = b.graph.placeholder("bias", default_value=None)
    with_entropy = b.graph.placeholder("with_entropy", default_value=False)
    row_chunk = b.graph.placeholder("row_chunk", default_value=None)
    rows, next_rows, _ = log_prob_rows(layout)
    # the targets keep the token ids' host-known range, so the head checks them without a device read
    targets = b.call(host.index_select, (input_ids, b.buffer("next_token_rows", next_rows)), name="targets")
    result = b.call(
        compact_log_probs,
        (hidden, weight, bias, b.buffer("logit_rows", rows), targets),
        {"with_entropy": with_entropy, "row_chunk": row_chunk},
        name="mapped",
    )
    log_probs = b.call(operator.getitem, (result, 0), name="log_probs")
    entropy = b.call(operator.getitem, (result, 1), name="entropy")
    return b.finish((log_probs, entropy), "CompactLogProbs")


def build_program(layout: MicrobatchLayout, kind: str, kernels=None, **options) -> torch.fx.GraphModule:
    """The program of ``kind`` (one of :data:`PROGRAM_KINDS`) for a layout; ``conv`` and ``packed_conv`` take ``width``."""
    if kind == "linear_attention":
        return build_linear_attention_program(layout, kernels)
    if kind == "conv":
        return build_conv_program(layout, options["width"], kernels)
    if kind == "attention":
        return build_attention_program(layout, kernels)
    if kind == "cascade_attention":
        return build_cascade_attention_program(layout, kernels)
    if kind == "log_probs":
        return build_log_prob_program(layout)
    if kind == "packed_linear_attention":
        return build_packed_linear_attention_program(layout, kernels)
    if kind == "packed_conv":
        return build_packed_conv_program(layout, options["width"], kernels)
    raise ValueError(f"unknown program kind {kind!r}; expected one of {', '.join(PROGRAM_KINDS)}")


def _describe(program: torch.fx.GraphModule) -> str:
    lines = [f"#   {name}: {module.extra_repr()}" for name, module in program.named_children()
             if isinstance(module, (RowGather, RowScatter, CascadeAttention))]
    for name, tensor in program.named_buffers(recurse=False):
        preview = tensor.tolist()[:12]
        more = ", ..." if tensor.numel() > 12 else ""
        lines.append(f"#   {name}: int64[{tensor.numel()}] = {str(preview)[1:-1]}{more}")
    return "\n".join(lines)


def render_programs(layout: MicrobatchLayout, conv_width: int = 4) -> str:
    """The generated programs of one microbatch as readable text (for IR dumps)."""
    header = (
        f"# microbatch {layout.microbatch}: {layout.num_rows} compact rows, {layout.semantic_tokens} semantic positions, "
        f"{layout.num_sequences} sequences in {layout.num_rounds} rounds, {layout.num_exports} exported states, "
        f"{layout.replay_tokens} replay rows, chunk size {layout.chunk_size}\n"
    )
    parts = [header]
    programs = [
        ("linear attention", build_linear_attention_program(layout)),
        (f"causal convolution (width {conv_width})", build_conv_program(layout, conv_width)),
        ("attention", build_attention_program(layout)),
        ("log-probs", build_log_prob_program(layout)),
    ]
    cascade = build_cascade_attention_program(layout)
    if any(isinstance(module, CascadeAttention) for module in cascade.children()):
        programs.insert(3, ("attention split at the forks (cascade_attention)", cascade))
    packed = linear_rows(layout)
    if packed["has_replay"]:
        where = f"on the linear-attention layers' {packed['rows'].size} packed rows (TreeView.pack_linear_rows)"
        programs[2:2] = [
            (f"linear attention, {where}", build_packed_linear_attention_program(layout)),
            (f"causal convolution (width {conv_width}), {where}", build_packed_conv_program(layout, conv_width)),
        ]
    for title, program in programs:
        parts.append(f"# --- {title}: {type(program).__name__}\n")
        described = _describe(program)
        if described:
            parts.append(described + "\n")
        parts.append(program.code.strip("\n") + "\n\n")
    return "".join(parts)
