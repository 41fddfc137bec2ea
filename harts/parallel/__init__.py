"""megatron-core execution of HARTS plans: tensor, sequence and expert parallelism, vocab-parallel log-probs.

    layout = harts.parallel.initialize(tensor_parallel=2, expert_parallel=2)   # after torch.distributed.init_process_group
    model = harts.parallel.TensorParallelHybridModel.from_model(native, token_dispatcher="allgather")   # this rank's shard
    out = harts.runtime.log_probs(model, plan, batch)           # same API, same plan on every TP rank

HARTS owns the math (the native layers run per local head, the plan's views per rank);
megatron-core owns the layout (``ColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding``, ``MoELayer`` and its token dispatchers, ``parallel_state``'s
groups). Importing this package imports megatron-core.
"""

from harts.parallel.checkpoint import save_pretrained
from harts.parallel.logprobs import vocab_parallel_compact_log_probs
from harts.parallel.mappings import gather_rows, padded_rows, reduce_scatter_rows, scatter_rows
from harts.parallel.model import TensorParallelError, TensorParallelHybridModel, local_config
from harts.parallel.moe import DISPATCHERS, HartsMoELayer, HartsRouter, LocalExperts
from harts.parallel.state import ParallelLayout, initialize, layout

__all__ = [
    "DISPATCHERS",
    "HartsMoELayer",
    "HartsRouter",
    "LocalExperts",
    "ParallelLayout",
    "TensorParallelError",
    "TensorParallelHybridModel",
    "gather_rows",
    "initialize",
    "layout",
    "local_config",
    "padded_rows",
    "reduce_scatter_rows",
    "save_pretrained",
    "scatter_rows",
    "vocab_parallel_compact_log_probs",
]
