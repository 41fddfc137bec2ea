"""Per-token log-probs (and entropies, and batch metadata) in the tensor layouts of the RL frameworks.

HARTS returns ``out.log_probs[i][t] = log p(tokens_i[t+1] | tokens_i[:t+1])`` (a list, or
``out.packed`` with ``out.cu_seqlens``), for a plan and the baseline alike. Each framework's
loss reads another arrangement of the same numbers; :func:`to_layout` builds it with one
differentiable gather, so gradients flow back into the plan's compact rows.

Every layout is a set of *slots*; each slot belongs to one token ``s`` of one trajectory (or
to none: padding, which holds 0). A log-prob slot holds the log-prob *of* its token,
``log p(tokens[s] | tokens[:s])`` = ``out.log_probs[i][s - 1]``; a metadata slot
(:meth:`FrameworkLayout.token_field`) holds the token-aligned batch value ``field[i][s]``, so both
line up elementwise as the framework's loss expects. The layouts:

``"verl"``  ``[B, R]``, response tokens only, right-padded, label-aligned: slot ``(i, j)`` is
    token ``P_i + j`` (``P_i`` the prompt length). verl's losses slice the engine's output to the
    response this way (``no_padding_2_padding`` in ``verl/workers/utils/padding.py``), and
    ``old_log_probs``, ``ref_log_prob``, ``advantages`` and
    ``response_mask`` share this ``[B, R]`` shape in ``compute_policy_loss``
    (``verl/trainer/ppo/core_algos.py``); the agent loop's ``response_mask`` is 0 on tool /
    observation tokens (``verl/experimental/agent_loop``).
``"trl"``  the same arrangement: ``GRPOTrainer._get_per_token_logps`` keeps the last
    ``logits_to_keep = completion_ids.size(1)`` logits before the final one and gathers
    ``completion_ids``, giving ``[B, C]`` next to ``completion_mask`` (and ``tool_mask`` for
    tool tokens) and ``old_per_token_logps`` / ``ref_per_token_logps``
    (``trl/trainer/grpo_trainer.py``).
``"nemo"``  ``[B, S-1]`` full-length shifted, right-padded: slot ``(i, t)`` is token ``t + 1``.
    NeMo-RL stores ``prev_logprobs``, ``token_mask`` and ``advantages`` as ``[B, S]`` and its
    ``ClippedPGLossFn`` slices ``[:, 1:]`` to meet the current log-probs of
    ``input_ids[:, 1:]`` from ``next_token_logits[:, :-1]`` (``nemo_rl/algorithms/loss_functions.py``).
``"areal"``  packed 1-D ``[sum len_i]`` with ``cu_seqlens``, next-token aligned: slot ``t`` of
    trajectory ``i`` is token ``t + 1`` (the last entry of each trajectory holds 0). This is what
    AReaL's losses read (``grpo_loss_fn`` / ``ppo_actor_loss_fn``, ``areal/trainer/ppo/actor.py``,
    ``areal/utils/functional``): its engine gathers the log-probs of the packed micro-batch at
    ``torch.roll(input_ids, -1)`` (``FSDPEngine._compute_logprobs``, ``areal/engine/fsdp_engine.py``)
    and ``PPOActor.compute_advantages`` rolls the stored ``loss_mask`` / ``logprobs`` by -1 to meet
    them. :meth:`LayoutSpec.token_field` of this layout rolls a token-aligned field the same way.
``"nested"``  a ``torch.nested`` jagged tensor ``[B, j]`` with ``j = len_i``, next-token
    aligned: entry ``t`` is token ``t + 1`` and the last entry of each trajectory holds 0. This
    is the ``log_probs`` model output of verl's new engine: its ``ppo_loss`` slices the response
    with ``values[offset - R_i - 1 : offset - 1]`` and its ``sft_loss`` rolls the token-aligned
    ``loss_mask`` by -1 to meet it (``verl/workers/utils/losses.py``, ``padding.py``).

The prompt length ``P_i`` of the ``verl`` / ``trl`` layouts comes from ``prompt_lengths=`` or
the batch's per-trajectory field ``prompt_length`` (the importers of :mod:`harts.interop`
set it). ``width=`` fixes ``R`` (``verl``/``trl``) or ``S`` (``nemo``) to the framework's padded
width; by default it is the longest trajectory's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from harts.rollouts.batch import RolloutBatch
from harts.errors import HartsError

__all__ = ["LAYOUTS", "PROMPT_LENGTH", "LayoutError", "FrameworkLayout", "layout_spec", "to_layout"]

LAYOUTS = ("verl", "trl", "nemo", "areal", "nested")

#: Per-trajectory batch field holding the number of prompt tokens (set by the importers).
PROMPT_LENGTH = "prompt_length"


class LayoutError(HartsError, ValueError):
    """A layout cannot be built: unknown name, missing prompt lengths, a width too small, mismatched values."""


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@attrs.frozen(eq=False)
class FrameworkLayout:
    """Where every slot of a framework layout comes from.

    Attributes:
        name: the layout (one of :data:`LAYOUTS`).
        lengths: [B] tokens per trajectory.
        slot_trajectory, slot_position: [slots] the trajectory and token each slot belongs
            to, in the layout's memory order; ``slot_position`` is -1 for padding.
        shape: the dense shape (``(slots,)`` for ``areal``; ``(B, -1)`` for ``nested``).
        offsets: ``cu_seqlens`` of the packed / jagged layouts, else None.
        prompt_lengths: [B] for ``verl`` / ``trl``, else None.
    """

    name: str
    lengths: np.ndarray
    slot_trajectory: np.ndarray
    slot_position: np.ndarray
    shape: tuple[int, ...]
    offsets: np.ndarray | None = None
    prompt_lengths: np.ndarray | None = None

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        """[B + 1] offsets of the ``areal`` / ``nested`` layouts (int32 as AReaL's), else None."""
        return None if self.offsets is None else torch.as_tensor(self.offsets, dtype=torch.int32)

    @property
    def mask(self) -> torch.Tensor:
        """True where a slot holds a token's value (the framework's valid positions)."""
        return self._arrange(torch.as_tensor(self.slot_position >= 0))

    def log_probs(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-trajectory next-token values (``len_i - 1`` each, as ``out.log_probs``) in this layout."""
        values = list(values)
        if len(values) != len(self.lengths):
            raise LayoutError(f"{len(values)} per-trajectory tensors for a batch of {len(self.lengths)} trajectories")
        for index, (value, length) in enumerate(zip(values, self.lengths)):
            if value.dim() != 1 or value.shape[0] != length - 1:
                raise LayoutError(
                    f"trajectory {index}: {tuple(value.shape)} values, expected {length - 1} (one per token after the first)"
                )
        source = np.where(self.slot_position >= 1, _offsets(self.lengths - 1)[self.slot_trajectory] + self.slot_position - 1, -1)
        return self._place(torch.cat(values), source)

    def token_field(self, values: Sequence[Any]) -> torch.Tensor:
        """Token-aligned per-trajectory values (``field[i][t]`` belongs to ``tokens[i][t]``) in this layout."""
        arrays = [v if isinstance(v, torch.Tensor) else torch.tensor(np.asarray(v)) for v in values]  # copies: batch fields are read-only
        if len(arrays) != len(self.lengths):
            raise LayoutError(f"{len(arrays)} per-trajectory arrays for a batch of {len(self.lengths)} trajectories")
        for index, (array, length) in enumerate(zip(arrays, self.lengths)):
            if array.dim() != 1 or array.shape[0] != length:
                raise LayoutError(f"trajectory {index}: {tuple(array.shape)} values, expected {length} (one per token)")
        source = np.where(self.slot_position >= 0, _offsets(self.lengths)[self.slot_trajectory] + self.slot_position, -1)
        return self._place(torch.cat(arrays), source)

    def _place(self, flat: torch.Tensor, source: np.ndarray) -> torch.Tensor:
        # One gather from the values plus a trailing zero (the padding source): differentiable.
        padded = torch.cat([flat, flat.new_zeros(1)])
        index = torch.as_tensor(np.where(source >= 0, source, flat.shape[0]), dtype=torch.long, device=flat.device)
        return self._arrange(padded.index_select(0, index))

    def _arrange(self, slots: torch.Tensor) -> torch.Tensor:
        if self.name == "nested":
            return torch.nested.nested_tensor_from_jagged(slots, offsets=torch.as_tensor(self.offsets, device=slots.device))
        return slots.reshape(self.shape)


def _prompt_lengths(batch: RolloutBatch, prompt_lengths: Any, name: str) -> np.ndarray:
    if prompt_lengths is None:
        if PROMPT_LENGTH not in batch.trajectory_fields:
            raise LayoutError(
                f"the {name!r} layout keeps response tokens only and needs each trajectory's prompt length: pass "
                f"prompt_lengths= or give the batch a per-trajectory field '{PROMPT_LENGTH}' (the importers set it)"
            )
        prompt_lengths = batch.trajectory_fields[PROMPT_LENGTH]
    values = np.asarray(prompt_lengths)
    if values.shape != (len(batch),) or values.dtype.kind not in "iu":
        raise LayoutError(f"field '{PROMPT_LENGTH}': expected one integer per trajectory ({len(batch)}), got {values.dtype} {values.shape}")
    lengths = batch.lengths
    for index, (prompt, length) in enumerate(zip(values.tolist(), lengths.tolist())):
        if not 1 <= prompt <= length:
            raise LayoutError(
                f"trajectory {index}: field '{PROMPT_LENGTH}' is {prompt}, outside [1, {length}]; a response token "
                "needs at least one token before it to be scored"
            )
    return values.astype(np.int64)


#: The most slots (trajectories x columns) a padded layout may have: frameworks index them with 32-bit
#: offsets, and a larger width is a mistake (``1e12``) that would otherwise end in a MemoryError.
MAX_LAYOUT_SLOTS = 2**31 - 1


def _width(width: int | None, needed: np.ndarray, what: str) -> int:
    longest = int(needed.max(initial=0))
    if width is None:
        return longest
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise LayoutError(f"width must be an integer number of columns, got {width!r}")
    if width * max(len(needed), 1) > MAX_LAYOUT_SLOTS:
        raise LayoutError(
            f"width {width:,} for {len(needed)} trajectories makes {width * max(len(needed), 1):,} slots, above "
            f"{MAX_LAYOUT_SLOTS:,}: give the framework's padded width (at least {longest})"
        )
    if width < longest:
        worst = int(np.argmax(needed))
        raise LayoutError(f"width {width} is too small: trajectory {worst} needs {longest} {what}")
    return int(width)


def layout_spec(batch: RolloutBatch, name: str, *, prompt_lengths: Any = None, width: int | None = None) -> FrameworkLayout:
    """The slot map of layout ``name`` for ``batch`` (see the module docstring)."""
    if name not in LAYOUTS:
        raise LayoutError(f"unknown layout {name!r}; expected one of {', '.join(LAYOUTS)}")
    lengths = batch.lengths
    count = len(lengths)
    if name in ("verl", "trl"):
        prompts = _prompt_lengths(batch, prompt_lengths, name)
        responses = lengths - prompts
        columns = _width(width, responses, "response columns")
        column = np.arange(columns, dtype=np.int64)[None, :]
        position = np.where(column < responses[:, None], prompts[:, None] + column, -1)
        return FrameworkLayout(name, lengths, np.repeat(np.arange(count), columns), position.reshape(-1), (count, columns),
                          prompt_lengths=prompts)
    if name == "nemo":
        columns = max(_width(width, lengths, "tokens") - 1, 0)
        column = np.arange(columns, dtype=np.int64)[None, :]
        position = np.where(column + 1 < lengths[:, None], column + 1, -1)
        return FrameworkLayout(name, lengths, np.repeat(np.arange(count), columns), position.reshape(-1), (count, columns))
    offsets = _offsets(lengths)
    trajectory = np.repeat(np.arange(count), lengths)
    step = np.arange(offsets[-1], dtype=np.int64) - offsets[trajectory]
    position = np.where(step + 1 < lengths[trajectory], step + 1, -1)  # both next-token aligned, last entry 0
    shape = (int(offsets[-1]),) if name == "areal" else (count, -1)
    return FrameworkLayout(name, lengths, trajectory, position, shape, offsets=offsets)


def to_layout(
    out: Any,
    batch: RolloutBatch,
    name: str,
    *,
    entropy: bool = False,
    prompt_lengths: Any = None,
    width: int | None = None,
) -> torch.Tensor:
    """The log-probs (or, with ``entropy=True``, the entropies) of ``out`` in framework layout ``name``.

    ``out`` is a :class:`harts.runtime.LogProbOutput` (from ``log_probs`` on any plan, or from
    ``log_probs_baseline``) or a list of per-trajectory tensors as its ``log_probs``. A
    ``LogProbOutput`` computed for another batch (another :meth:`~harts.RolloutBatch.input_hash`)
    is refused: its rows would land on the wrong trajectories even when the lengths match. The
    result is differentiable; padding holds 0. ``prompt_lengths`` and ``width``: see the
    module docstring; the slot map itself is :func:`layout_spec`.
    """
    if isinstance(out, (list, tuple)):
        values = out
    else:
        computed_for = getattr(out, "input_hash", None)
        if computed_for is not None and computed_for != batch.input_hash():
            raise LayoutError(
                f"the output was computed for batch {computed_for[:20]}..., not for this batch "
                f"({batch.input_hash()[:20]}...): pass the batch the log-probs were computed on"
            )
        values = getattr(out, "entropy" if entropy else "log_probs", None)
        if values is None:
            raise LayoutError(
                "the output holds no entropies: compute them with with_entropy=True" if entropy
                else f"expected a LogProbOutput or a list of tensors, got {type(out).__name__}"
            )
    return layout_spec(batch, name, prompt_lengths=prompt_lengths, width=width).log_probs(values)
