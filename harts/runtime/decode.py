"""Incremental decoding with the model's own layers: the sampler of online RL rollouts.

A rollout engine samples token by token; HARTS trains on what it sampled. This decoder runs
the :class:`~harts.runtime.model.HybridModel`'s own blocks (projections, norms, gates, RoPE,
MoE routing) on the new tokens only, through an execution view that carries each
sequence's history between calls instead of recomputing it:

* short causal convolution: the last ``W - 1`` inputs of each sequence (the kernels'
  ``context`` argument);
* linear attention (KDA, Gated DeltaNet): the recurrent state ``[H, K, V]`` of each sequence
  (the kernels' ``initial_state`` in, ``final_state`` out);
* full attention (MHA / GQA / MLA): a KV cache of the keys and values after RoPE; new
  queries attend to cache + own keys, bottom-right causal;
* RoPE positions continue from each sequence's length; MoE routes each new token once.

The kernels are the ones the training runs call (:mod:`harts.kernels.dispatch`), so the
log-prob of a sampled token under the decoder equals its teacher-forced log-prob from
:func:`harts.runtime.log_probs_baseline` on the finished trajectory up to round-off
(float64: ~1e-13).

States are immutable: :meth:`IncrementalDecoder.extend` returns new :class:`DecodeState`
objects and never changes its inputs, so forking a sequence (at a turn boundary, or in the
middle of a turn) is using one state twice, and continuing each with different samples.

    decoder = IncrementalDecoder(model)
    root = decoder.extend([decoder.start()], [prompt])[0]          # prefill
    branches = [root] * 4                                          # fork
    tokens, _ = decoder.sample(branches, generator)                # one token each
    branches = decoder.extend(branches, [[t] for t in tokens])
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

from harts.errors import ModelInputError
from harts.kernels import dispatch as default_kernels
from harts.kernels.interface import Kernels
from harts.numerics import compute_dtype
from harts.runtime.api import DEFAULT_CHUNK_SIZE, _check_temperature, unwrap_model

__all__ = ["DecodeState", "IncrementalDecoder", "LayerCache", "gumbel_sample"]


@attrs.frozen(eq=False)
class LayerCache:
    """What one block remembers of one sequence (None: nothing yet, the zero state / empty cache).

    ``conv``: [W-1, D] last inputs of the short convolution (oldest first); ``state``: [H, K, V]
    linear-attention state; ``keys`` / ``values``: [T, Hkv, Dk] / [T, Hkv, Dv] attention cache.
    """

    conv: torch.Tensor | None = None
    state: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


@attrs.frozen(eq=False)
class DecodeState:
    """One sequence after the decoder consumed ``tokens``: per-block caches and the next-token log-probs.

    ``next_log_probs`` [V] = log p(. | tokens) at the decoder's temperature (None before the
    first token).
    """

    tokens: tuple[int, ...]
    layers: tuple[LayerCache, ...]
    next_log_probs: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)


class _DecodeView:
    """Execution view of one block over the new tokens of N sequences, reading and updating their caches."""

    def __init__(self, caches: Sequence[LayerCache], lengths: Sequence[int], positions: torch.Tensor,
                 chunk_size: int, kernels: Kernels):
        device = positions.device
        self.caches = list(caches)
        self.lengths = [int(n) for n in lengths]
        self.num_rows = sum(self.lengths)
        self.positions = positions
        self.row_weight = torch.ones(self.num_rows, device=device)
        # Any chunk size gives the same recurrence; the shortest grid that covers the new tokens wastes no padding.
        self.chunk_size = max(1, min(chunk_size, max(self.lengths, default=1)))
        self.kernels = kernels
        self.cu_seqlens = torch.zeros(len(self.lengths) + 1, dtype=torch.long, device=device)
        self.cu_seqlens[1:] = torch.cumsum(torch.as_tensor(self.lengths, dtype=torch.long, device=device), 0)
        self.updates: list[dict[str, torch.Tensor]] = [{} for _ in self.caches]

    def _pieces(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.split(self.lengths))

    def causal_conv(self, x, weight, bias, activation):
        history = int(weight.shape[-1]) - 1
        context = torch.stack([
            x.new_zeros(history, x.shape[1]) if cache.conv is None else cache.conv.to(x.dtype) for cache in self.caches
        ])
        y = self.kernels.causal_conv1d(x, weight, bias, self.cu_seqlens, context=context, activation=activation)
        for index, piece in enumerate(self._pieces(x)):
            self.updates[index]["conv"] = torch.cat([context[index], piece])[-history:] if history else context[index]
        return y

    def linear_attention(self, q, k, v, log_decay, beta, *, scale):
        heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
        work = torch.promote_types(q.dtype, torch.float32)
        initial = torch.stack([
            q.new_zeros(heads, key_dim, value_dim, dtype=work) if cache.state is None else cache.state
            for cache in self.caches
        ])
        o, final, _ = self.kernels.chunk_linear_attention(
            q, k, v, log_decay, beta, self.cu_seqlens, chunk_size=self.chunk_size, scale=scale, initial_state=initial
        )
        for index in range(len(self.caches)):
            self.updates[index]["state"] = final[index]
        return o

    def attention(self, q, k, v, *, scale):
        keys, values, key_lengths = [], [], []
        for index, (cache, new_k, new_v) in enumerate(zip(self.caches, self._pieces(k), self._pieces(v))):
            all_k = new_k if cache.keys is None else torch.cat([cache.keys, new_k])
            all_v = new_v if cache.values is None else torch.cat([cache.values, new_v])
            self.updates[index]["keys"], self.updates[index]["values"] = all_k, all_v
            keys.append(all_k)
            values.append(all_v)
            key_lengths.append(all_k.shape[0])
        cu_k = torch.zeros(len(key_lengths) + 1, dtype=torch.long, device=q.device)
        cu_k[1:] = torch.cumsum(torch.as_tensor(key_lengths, dtype=torch.long, device=q.device), 0)
        return self.kernels.attention(q, torch.cat(keys), torch.cat(values), self.cu_seqlens, cu_k, scale=scale, causal=True)

    def updated(self) -> list[LayerCache]:
        return [attrs.evolve(cache, **update) for cache, update in zip(self.caches, self.updates)]


def gumbel_sample(log_probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample one index per row of ``log_probs`` [N, V] by the Gumbel-max trick, noise from ``generator``.

    The noise is drawn on the CPU in float64 whatever the device and dtype of the log-probs,
    so one generator state gives the same draws everywhere; only the log-probs decide.
    """
    uniform = torch.rand(log_probs.shape, generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float64).tiny)))
    return (log_probs.detach().to("cpu", torch.float64) + gumbel).argmax(dim=-1)


class IncrementalDecoder:
    """Token-by-token decoding of a :class:`~harts.runtime.HybridModel` with per-sequence caches (module docstring).

    Args:
        model: the model (a data-parallel wrapper is unwrapped: decoding needs no gradient sync).
        temperature: next-token log-probs are those of ``logits / temperature``.
        kernels: kernels namespace (default: the dispatch the runtime uses).
        chunk_size: the linear-attention chunk of each call (decoding has no plan; results do
            not depend on it beyond round-off).
    """

    def __init__(self, model: nn.Module, *, temperature: float = 1.0, kernels: Kernels | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE):
        self.model = unwrap_model(model)
        self.temperature = _check_temperature(temperature)
        self.kernels = kernels if kernels is not None else default_kernels
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ModelInputError(f"IncrementalDecoder: chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def start(self) -> DecodeState:
        """The state before any token."""
        return DecodeState(tokens=(), layers=tuple(LayerCache() for _ in self.model.layers))

    @torch.no_grad()
    def extend(self, states: Sequence[DecodeState], tokens: Sequence[Sequence[int]]) -> list[DecodeState]:
        """Feed ``tokens[i]`` (one or more, e.g. a prompt, an observation or one sample) to ``states[i]``.

        Returns the new states; the given ones stay valid (fork by extending one state twice).
        """
        if len(states) != len(tokens):
            raise ModelInputError(f"extend: {len(states)} state(s) but {len(tokens)} token list(s)")
        pieces = [[int(t) for t in piece] for piece in tokens]
        if not states:
            return []
        if any(not piece for piece in pieces):
            raise ModelInputError(f"extend: sequence {next(i for i, p in enumerate(pieces) if not p)} gets no token")
        model = self.model
        vocab = model.config.vocab_size
        for index, piece in enumerate(pieces):
            if min(piece) < 0 or max(piece) >= vocab:
                raise ModelInputError(f"extend: sequence {index} holds a token outside the vocabulary [0, {vocab})")
        device = model.device
        lengths = [len(piece) for piece in pieces]
        input_ids = torch.as_tensor([t for piece in pieces for t in piece], dtype=torch.long, device=device)
        positions = torch.cat([
            torch.arange(state.length, state.length + n, dtype=torch.long, device=device) for state, n in zip(states, lengths)
        ])

        x = model.embed(input_ids)
        new_layers: list[list[LayerCache]] = []
        for index, layer in enumerate(model.layers):
            view = _DecodeView([state.layers[index] for state in states], lengths, positions, self.chunk_size, self.kernels)
            x, _ = layer(x, view)
            new_layers.append(view.updated())
        last_rows = torch.cumsum(torch.as_tensor(lengths, device=device), 0) - 1
        hidden = model.norm(x).index_select(0, last_rows)
        logits = model.logits(hidden)
        logits = logits.to(compute_dtype(logits.dtype)) / self.temperature
        next_log_probs = torch.log_softmax(logits, dim=-1)
        return [
            DecodeState(
                tokens=state.tokens + tuple(piece),
                layers=tuple(layer_caches[i] for layer_caches in new_layers),
                next_log_probs=next_log_probs[i],
            )
            for i, (state, piece) in enumerate(zip(states, pieces))
        ]

    def sample(self, states: Sequence[DecodeState], generator: torch.Generator) -> tuple[list[int], list[float]]:
        """One next token per state (Gumbel-max on its next-token log-probs) and its log-prob."""
        if not states:
            return [], []
        if any(state.next_log_probs is None for state in states):
            raise ModelInputError("sample: a state has consumed no token yet (extend it with a prompt first)")
        log_probs = torch.stack([state.next_log_probs for state in states])
        chosen = gumbel_sample(log_probs, generator)
        picked = log_probs.to("cpu", torch.float64).gather(1, chosen[:, None])[:, 0]
        return chosen.tolist(), picked.tolist()
