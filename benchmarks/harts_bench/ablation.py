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

``NodeAtATimeView`` is the scheduling ablation of Tree Training's Gated DeltaNet path on a
compiled plan: the same compact rows and the same conv / attention / token-wise work as
:class:`~harts.runtime.tree_view.TreeView`, but linear attention issues one chunkwise call per
node of the microbatch's trie (:class:`TrieNodes`: maximal fork-free row runs), parents before
children, each node starting from the exact final state of its parent's call. Nodes are not
packed together and nothing is replayed, so the chunk grid restarts at every node start: the
mathematics is unchanged, the floating-point path is the no-replay one (it equals
``NoReplayView`` with the microbatch's node starts as cuts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import torch

from harts.codegen.fx import default_kernels
from harts.codegen.layout import MicrobatchLayout
from harts.ir.nodes import CompactTrie
from harts.kernels.attention.tree_mask import layout_parents
from harts.runtime.programs import RUNTIME_CACHE
from harts.runtime.tree_view import TreeView
from harts.runtime.view import BaselineView

__all__ = [
    "CascadeAttentionView",
    "PackedLinearRowsView",
    "NoReplayView",
    "NodeAtATimeView",
    "TrieNodes",
    "divergence_by_depth",
    "fork_positions",
    "handoff_depths",
]


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


@attrs.frozen(eq=False)
class TrieNodes:
    """The nodes of one microbatch's trie on its compact layout, in row order.

    A node is a maximal fork-free run of rows: it begins at a root row (position 0) or at a
    child of a row with two or more children, so a trajectory that ends where another member
    continues does not split a node (the same rule as the ``segment`` pass). Node ``n`` covers
    rows ``row_start[n] : row_start[n] + length[n]`` (contiguous: a fork-free run lies inside
    one input sequence of the layout), which are positions ``position[n] : position[n] +
    length[n]`` of every member trajectory through it. ``parent[n]`` is the node holding the
    row before its first row (-1 for a root). Nodes tile the rows in index order; ``order``
    lists them parents first, the order their calls are issued in.
    """

    microbatch: int
    row_start: np.ndarray
    length: np.ndarray
    position: np.ndarray
    parent: np.ndarray
    order: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.row_start.shape[0])

    @property
    def has_children(self) -> np.ndarray:
        """[N] bool: some node starts from this node's final state."""
        flags = np.zeros(self.num_nodes, dtype=bool)
        flags[self.parent[self.parent >= 0]] = True
        return flags

    @classmethod
    def from_layout(cls, layout: MicrobatchLayout) -> TrieNodes:
        """The nodes of a layout, cached in the runtime's layout cache (every view and layer reuses them)."""
        return RUNTIME_CACHE.get(layout, ("trie_nodes",), lambda: cls._build(layout))

    @classmethod
    def _build(cls, layout: MicrobatchLayout) -> TrieNodes:
        parent_row = layout_parents(layout)
        rows = layout.num_rows
        children = np.bincount(parent_row[parent_row >= 0], minlength=rows)
        has_parent = parent_row >= 0
        starts = ~has_parent
        starts[has_parent] = children[parent_row[has_parent]] >= 2
        continuing = np.flatnonzero(~starts)
        misplaced = continuing[parent_row[continuing] != continuing - 1]
        if misplaced.size:
            row = int(misplaced[0])
            raise ValueError(
                f"layout of microbatch {layout.microbatch}: row {row} continues a fork-free run but its parent is "
                f"row {int(parent_row[row])}, not the row before it; the node would not be a contiguous row range"
            )
        row_start = np.flatnonzero(starts).astype(np.int64)
        length = np.diff(np.append(row_start, rows)).astype(np.int64)
        node_of_row = np.cumsum(starts) - 1
        first_parent = parent_row[row_start]
        parent = np.where(first_parent >= 0, node_of_row[np.maximum(first_parent, 0)], -1).astype(np.int64)
        return cls(
            microbatch=layout.microbatch,
            row_start=row_start,
            length=length,
            position=np.asarray(layout.row_position, dtype=np.int64)[row_start],
            parent=parent,
            order=_parents_first(parent),
        )


def _parents_first(parent: np.ndarray) -> np.ndarray:
    """A preorder of the forest given by ``parent`` (every node after its parent)."""
    count = parent.shape[0]
    children: list[list[int]] = [[] for _ in range(count)]
    roots = []
    for node, up in enumerate(parent.tolist()):
        (roots if up < 0 else children[up]).append(node)
    order, stack = [], roots[::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(children[node][::-1])
    if len(order) != count:
        raise ValueError("node parents do not form a forest")
    return np.asarray(order, dtype=np.int64)


class PackedLinearRowsView(TreeView):
    """TreeView whose linear-attention layers run on the packed rows (:attr:`TreeView.pack_linear_rows`: the
    hidden rows gathered into round order once, the rounds slices of them) instead of every round packing its
    q, k, v, decay and beta from the compact rows, for an A/B of the two on one plan in one process."""

    pack_linear_rows = True


class CascadeAttentionView(TreeView):
    """TreeView whose full-attention layers run split at the forks (``cascade_attention``: own rows in place,
    each ancestor run once per fork, merged by log-sum-exp) instead of one gathered key/value view per
    sequence, for an A/B of the two on one plan in one process."""

    attention_program = "cascade_attention"


class NodeAtATimeView(TreeView):
    """A compiled microbatch's view whose linear attention runs one call per trie node.

    Everything but linear attention is :class:`TreeView`'s (same generated programs, same
    rows; the linear-attention layers on the compact rows, as a node replays nothing). Linear
    attention: for every node of :class:`TrieNodes`, parents first, one chunkwise call over the
    node's own rows, starting from the parent call's final state (zero state at a root).
    Gradients flow through the chained states. Constructor as :class:`TreeView`.
    """

    def __init__(self, layout: MicrobatchLayout, device=None, *, kernels=None):
        super().__init__(layout, device, kernels=kernels)
        self.nodes = TrieNodes.from_layout(layout)
        self._sizes = self.nodes.length.tolist()
        self._order = self.nodes.order.tolist()
        self._parent = self.nodes.parent.tolist()
        self._keep_final = self.nodes.has_children.tolist()
        # Host tensors: the kernels read cu_seqlens on the host, so a device copy would cost a
        # device-to-host sync per call, an overhead the ablation should not be charged.
        self._cu_seqlens = [torch.tensor([0, size], dtype=torch.long) for size in self._sizes]

    #: its linear attention runs per node on the compact rows, whatever TreeView's default
    pack_linear_rows = False

    def __repr__(self) -> str:
        return f"NodeAtATimeView(microbatch={self.layout.microbatch}, rows={self.num_rows}, nodes={self.nodes.num_nodes})"

    @property
    def linear_attention_calls(self) -> int:
        """Chunkwise calls per linear-attention layer: one per node."""
        return self.nodes.num_nodes

    def linear_attention(self, q, k, v, log_decay, beta, *, scale):
        self._check_rows(q, "linear_attention q")
        kernels = self.kernels if self.kernels is not None else default_kernels()
        # One split per input: its backward is one concatenation, where a slice per node would
        # materialise a full-size zero gradient per node.
        pieces = [x.split(self._sizes) for x in (q, k, v, log_decay, beta)]
        outputs: list[torch.Tensor | None] = [None] * len(self._sizes)
        finals: dict[int, torch.Tensor] = {}
        for node in self._order:
            parent = self._parent[node]
            o, final, _ = kernels.chunk_linear_attention(
                *(piece[node] for piece in pieces), self._cu_seqlens[node],
                chunk_size=self.chunk_size, scale=scale, initial_state=None if parent < 0 else finals[parent],
            )
            outputs[node] = o
            if self._keep_final[node]:
                finals[node] = final
        return torch.cat(outputs)


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
        target = torch.tensor(tokens[trajectory], device=ref_hidden.device)  # a copy: batch token arrays are read-only
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
