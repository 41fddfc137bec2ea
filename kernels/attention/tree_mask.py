"""Softmax attention over one shared KV buffer with a tree mask (FlexAttention).

The packed attention of :mod:`harts.kernels.attention.varlen` takes, per input sequence, its
queries and a gathered copy of its ancestors' keys/values: a branch forking from a long
shared prefix re-reads (and its backward re-accumulates) a private copy of that prefix.
This module is the alternative the issue asks to consider: every compact row appears once
as a query and once as a key/value, and a mask says who may see whom.

Row ``j`` is visible to row ``i`` iff ``j`` is ``i`` or one of its ancestors in the token
trie of the microbatch (the rows form a forest: ``parent[i]`` is the row of the previous
position of any trajectory through ``i``; -1 at a root). With rows renumbered in DFS
preorder, the ancestors-or-self of ``i`` are exactly the ``j`` with
``pre[j] <= pre[i] < pre[j] + subtree_size[j]``, so the mask is one comparison pair per
(query, key) block element; it is causal (ancestors precede descendants in preorder) and
sibling subtrees give empty blocks that FlexAttention skips. Rows are permuted into
preorder before the call and back after, so the caller keeps its compact layout.

Trade-offs against the gathered-KV path: no duplicated ancestor KV (memory and gather
traffic proportional to C instead of the sum of branch views), and one call per
microbatch; but FlexAttention needs ``torch.compile`` to be fast (compiled once per row
count), and its block sparsity is only as good as the preorder's locality. The runtime's
execution views use the gathered path (varlen FlashAttention); :func:`tree_attention` is
the drop-in for a view that wants the shared buffer instead: ``parent`` comes from
:func:`layout_parents`. On CPU (no FlexAttention backward there) it runs the same mask
densely, for tests.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np
import torch

__all__ = ["layout_parents", "preorder", "prepare", "tree_attention"]

_CACHE_SIZE = 16
_masks: OrderedDict = OrderedDict()
_compiled = {}


def layout_parents(layout) -> np.ndarray:
    """[C] parent row of every row of a :class:`~harts.codegen.layout.MicrobatchLayout` (-1 at roots)."""
    rows = np.asarray(layout.trajectory_rows, dtype=np.int64)
    offsets = np.asarray(layout.trajectory_offsets, dtype=np.int64)
    parent = np.full(layout.num_rows, -1, dtype=np.int64)
    not_first = np.ones(rows.shape[0], dtype=bool)
    not_first[offsets[:-1][offsets[:-1] < rows.shape[0]]] = False
    positions = np.flatnonzero(not_first)
    parent[rows[positions]] = rows[positions - 1]
    return parent


def preorder(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, leave): ``order[p]`` is the row at preorder position p; ``leave[p]`` is one past
    the last preorder position of that row's subtree."""
    parent = np.asarray(parent, dtype=np.int64)
    count = parent.shape[0]
    if np.any(parent >= count) or np.any(parent < -1):
        raise ValueError("parent must hold row indices in [-1, C)")
    children_count = np.bincount(parent[parent >= 0], minlength=count)
    child_start = np.concatenate([[0], np.cumsum(children_count)])
    by_parent = np.argsort(parent, kind="stable")[count - int(children_count.sum()) :]  # children grouped by parent
    order = np.empty(count, dtype=np.int64)
    leave = np.empty(count, dtype=np.int64)
    position = 0
    # iterative DFS; a node's leave is set when the stack unwinds past it
    stack: list[tuple[int, int]] = [(int(r), 0) for r in np.flatnonzero(parent < 0)[::-1]]
    entered = np.full(count, -1, dtype=np.int64)
    while stack:
        node, state = stack.pop()
        if state == 0:
            entered[node] = position
            order[position] = node
            position += 1
            stack.append((node, 1))
            kids = by_parent[child_start[node] : child_start[node + 1]]
            stack.extend((int(c), 0) for c in kids[::-1])
        else:
            leave[entered[node]] = position
    if position != count:
        raise ValueError("parent does not describe a forest (a cycle leaves rows unreachable from any root)")
    return order, leave


def _arrangement(parent: np.ndarray, device: torch.device, use_cache: bool = True):
    """(order, inverse, leave, block mask or None) of a parent array, cached: every attention
    layer of a microbatch reuses it."""
    key = (parent.tobytes(), str(device))
    cached = _masks.get(key) if use_cache else None
    if cached is not None:
        _masks.move_to_end(key)
        return cached
    order, leave = preorder(parent)
    leave_t = torch.as_tensor(leave, device=device)
    mask = None
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        def ancestor_or_self(batch, head, q_idx, kv_idx):
            # in preorder, kv is an ancestor-or-self of q iff q lies in kv's subtree interval
            return (kv_idx <= q_idx) & (q_idx < leave_t[kv_idx])

        count = parent.shape[0]
        with warnings.catch_warnings():
            # torch 2.11 suggests torch.compile(create_block_mask) instead of _compile=True; that
            # would recompile for every new closure, while _compile fuses the mask evaluation only
            warnings.filterwarnings("ignore", message="_compile flag on create_block_mask", category=DeprecationWarning)
            mask = create_block_mask(ancestor_or_self, None, None, count, count, device=device, _compile=True)
    cached = (torch.as_tensor(order, device=device), torch.as_tensor(np.argsort(order), device=device), leave_t, mask)
    _masks[key] = cached
    if len(_masks) > _CACHE_SIZE:
        _masks.popitem(last=False)
    return cached


def prepare(parent, device: torch.device | str, *, use_cache: bool = True) -> None:
    """Build the preorder arrangement and (on CUDA) the block mask of ``parent`` ahead of the
    first :func:`tree_attention` call, so that cost is paid once per microbatch rather than in
    the first attention layer; ``use_cache=False`` rebuilds it even when cached (to time it)."""
    parent = parent.detach().cpu().numpy() if isinstance(parent, torch.Tensor) else np.asarray(parent)
    _arrangement(parent.astype(np.int64), torch.device(device), use_cache)


def _flex(q, k, v, mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    if "cuda" not in _compiled:
        _compiled["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["cuda"](q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _dense(q, k, v, leave, scale):
    """The same masked attention with an explicit [C, C] mask (CPU: FlexAttention has no CPU backward)."""
    count = q.shape[2]
    positions = torch.arange(count, device=q.device)
    visible = (positions[None, :] <= positions[:, None]) & (positions[:, None] < leave[None, :])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scale
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return weights @ v.to(compute)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parent, *, scale: float) -> torch.Tensor:
    """Attention of every row over its ancestors-or-self in one shared KV buffer.

    Args:
        q: [C, Hq, Dk]; k: [C, Hkv, Dk]; v: [C, Hkv, Dv] (GQA: Hkv divides Hq).
        parent: [C] parent row of each row (-1 at roots), numpy or tensor.
        scale: softmax scale.
    Returns:
        o [C, Hq, Dv] in q's dtype, rows in the given order.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"q, k, v must be [C, H, D] over the same rows; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    parent = parent.detach().cpu().numpy() if isinstance(parent, torch.Tensor) else np.asarray(parent)
    if parent.shape != (q.shape[0],):
        raise ValueError(f"parent must have one entry per row ({q.shape[0]}), got shape {parent.shape}")
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    order, inverse, leave, mask = _arrangement(parent.astype(np.int64), q.device)

    def arrange(x):  # [C, H, D] in preorder -> [1, H, C, D]
        return x.index_select(0, order).transpose(0, 1).unsqueeze(0)

    if mask is not None:
        out = _flex(arrange(q), arrange(k), arrange(v), mask, scale)
    else:
        out = _dense(arrange(q), arrange(k), arrange(v), leave, scale)
    return out[0].transpose(0, 1).index_select(0, inverse).to(q.dtype)
