"""The replay ablation of §5.4: what happens when a side branch does not restore the chunk phase.

``NoReplayView`` runs every trajectory on its own (like the baseline) but cuts its
linear-attention recurrence at the trajectory's fork positions: the piece after a fork
starts from the exact state at the fork and is chunked from there, so its chunk grid is
shifted against the trajectory's own multiples of B. The mathematics is unchanged; only
the floating-point path differs, which is what the ablation measures.

``handoff_depths`` gives each position of a trajectory its state-handoff depth (how many
fork boundaries of the batch's segment tree lie before it), and ``divergence_by_depth``
reports the paper's Eq. 25-26 per depth: mean symmetric KL of the full-vocabulary
distributions and mean |delta NLL| of the next token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from harts.ir.nodes import CompactTrie
from harts.runtime.view import BaselineView


def fork_positions(trie: CompactTrie) -> list[list[int]]:
    """For every trajectory, the positions p where its path leaves a fork of the batch trie."""
    starts = trie.segment_starts()
    return [
        [node.start for node in trie.path(trajectory) if node.parent >= 0 and starts[node.id]]
        for trajectory in range(len(trie.leaf))
    ]


def handoff_depths(forks: Sequence[int], length: int) -> np.ndarray:
    """Depth of every position of a trajectory with fork positions ``forks``: the forks at or before it."""
    depth = np.zeros(length, dtype=np.int64)
    for position in forks:
        depth[position:] += 1
    return depth


class NoReplayView(BaselineView):
    """Baseline rows; linear attention restarts its chunk grid at every fork of each trajectory.

    ``cuts[i]`` are the fork positions of sequence i (sorted, inside ``(0, len_i)``). Piece k
    of every sequence runs in call k, starting from the final state of piece k-1.
    """

    def __init__(self, lengths: Sequence[int], cuts: Sequence[Sequence[int]], chunk_size: int, device=None, *, kernels=None):
        super().__init__(lengths, chunk_size, device, kernels=kernels)
        if len(cuts) != len(self.lengths):
            raise ValueError(f"NoReplayView: {len(cuts)} cut lists for {len(self.lengths)} sequences")
        self.pieces: list[list[tuple[int, int]]] = []
        for sequence, (length, positions) in enumerate(zip(self.lengths, cuts)):
            bounds = [0] + sorted(p for p in set(positions) if 0 < p < length) + [length]
            self.pieces.append(list(zip(bounds[:-1], bounds[1:])))
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def linear_attention(self, q, k, v, log_decay, beta, *, scale):
        heads, key_dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
        output = torch.zeros(q.shape[0], heads, value_dim, dtype=v.dtype, device=q.device)
        state = torch.zeros(len(self.lengths), heads, key_dim, value_dim, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for depth in range(max(len(p) for p in self.pieces)):
            active = [i for i, pieces in enumerate(self.pieces) if depth < len(pieces)]
            rows = np.concatenate([self.starts[i] + np.arange(*self.pieces[i][depth]) for i in active])
            lengths = [self.pieces[i][depth][1] - self.pieces[i][depth][0] for i in active]
            cu = torch.zeros(len(active) + 1, dtype=torch.long, device=q.device)
            cu[1:] = torch.cumsum(torch.tensor(lengths, device=q.device), 0)
            index = torch.as_tensor(rows, device=q.device)
            which = torch.as_tensor(active, device=q.device)
            piece_out, final, _ = self.kernels.chunk_linear_attention(
                q[index], k[index], v[index], log_decay[index], beta[index], cu,
                chunk_size=self.chunk_size, scale=scale, initial_state=state[which],
            )
            output = output.index_copy(0, index, piece_out.to(output.dtype))
            state = state.index_copy(0, which, final.to(state.dtype))
        return output


@torch.no_grad()
def divergence_by_depth(
    model,
    reference: Mapping[int, torch.Tensor],
    other: Mapping[int, torch.Tensor],
    tokens: Sequence[np.ndarray],
    depths: Mapping[int, np.ndarray],
    *,
    max_depth: int = 5,
    block_rows: int = 2048,
) -> dict[int, dict[str, float]]:
    """Eq. 25-26 per handoff depth 0..max_depth: mean SymKL and mean |delta NLL| of ``other`` vs ``reference``.

    ``reference[i]`` / ``other[i]`` are the final hidden states of trajectory i, one row per
    position; the last position has no next token and is skipped.
    """
    sums = {d: [0.0, 0.0, 0] for d in range(max_depth + 1)}
    for trajectory, ref_hidden in reference.items():
        target = torch.as_tensor(tokens[trajectory], device=ref_hidden.device)
        depth = torch.as_tensor(depths[trajectory], device=ref_hidden.device)
        for start in range(0, ref_hidden.shape[0] - 1, block_rows):
            stop = min(ref_hidden.shape[0] - 1, start + block_rows)
            log_p = torch.log_softmax(model.logits(ref_hidden[start:stop]).double(), -1)
            log_q = torch.log_softmax(model.logits(other[trajectory][start:stop]).double(), -1)
            symkl = 0.5 * ((log_p.exp() * (log_p - log_q)).sum(-1) + (log_q.exp() * (log_q - log_p)).sum(-1))
            next_tokens = target[start + 1 : stop + 1, None]
            delta_nll = (log_p.gather(1, next_tokens) - log_q.gather(1, next_tokens))[:, 0].abs()
            block_depth = depth[start:stop]
            for d in range(max_depth + 1):
                mask = block_depth == d
                if bool(mask.any()):
                    sums[d][0] += float(symkl[mask].sum())
                    sums[d][1] += float(delta_nll[mask].sum())
                    sums[d][2] += int(mask.sum())
    return {
        d: {"symkl": s / n if n else float("nan"), "mean_abs_delta_nll": a / n if n else float("nan"), "tokens": n}
        for d, (s, a, n) in sums.items()
    }
