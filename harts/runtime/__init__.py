"""Runtime: the hybrid-attention model, its execution views and the public log-prob entry points.

    model = harts.runtime.HybridModel(harts.runtime.HybridConfig.preset("tiny"))
    out = harts.runtime.log_probs(model, plan, batch)          # compiled plan, compact rows
    ref = harts.runtime.log_probs_baseline(model, batch)      # every trajectory on its own
    decoder = harts.runtime.IncrementalDecoder(model)        # token-by-token sampling with per-sequence caches
"""

from harts.runtime.api import LogProbOutput, MicrobatchOutput, log_probs, log_probs_baseline, microbatch_log_probs
from harts.runtime.config import PRESETS, HybridConfig, HybridConfigError
from harts.runtime.decode import DecodeState, IncrementalDecoder
from harts.numerics import compact_log_probs
from harts.runtime.model import HybridModel
from harts.runtime.moe import MoEStats, expert_load, load_balancing_loss, z_loss
from harts.runtime.tree_view import TreeView
from harts.runtime.view import BaselineView, ExecutionView

__all__ = [
    "PRESETS",
    "BaselineView",
    "DecodeState",
    "ExecutionView",
    "HybridConfig",
    "HybridConfigError",
    "HybridModel",
    "IncrementalDecoder",
    "LogProbOutput",
    "MicrobatchOutput",
    "MoEStats",
    "TreeView",
    "compact_log_probs",
    "expert_load",
    "load_balancing_loss",
    "log_probs",
    "log_probs_baseline",
    "microbatch_log_probs",
    "z_loss",
]
