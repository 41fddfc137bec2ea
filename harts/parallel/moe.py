"""MoE FFNs through megatron-core's ``MoELayer`` and token dispatchers, with HARTS' router and statistics.

megatron-core owns the layout: ``MoELayer`` runs route -> dispatch -> experts -> combine with
its all-gather (``allgather``) or all-to-all (``alltoall``) token dispatcher over the expert-
parallel group, each rank holding ``E / EP`` experts (expert tensor parallelism is 1: an
expert is whole on its rank). HARTS owns the math:

* the tokens are this rank's sequence-parallel compact rows, ``[C' / TP, D]``; rows added to
  make C' a multiple of TP (or, for the all-gather dispatcher, to equal the largest row count
  in the expert-parallel group) have multiplicity 0;
* :class:`HartsRouter` (plugged into ``MoESubmodules(router=...)``) routes with the native
  router's code (:class:`harts.runtime.moe.TopKRouter`: softmax / sigmoid, expert bias,
  group-limited selection, routed-experts replay) and measures the native q-weighted statistics
  (:func:`harts.runtime.moe.router_statistics`), so a padding row counts in none of them;
  megatron's own auxiliary losses are off (HARTS adds its losses from the statistics);
* :class:`LocalExperts` holds this rank's experts in the native / Hugging Face 3-D layout
  (``gate_up_proj`` [E / EP, 2I, D], ``down_proj`` [E / EP, D, I]) and runs the native expert
  kernel on the dispatched rows, so a checkpoint needs no renaming of expert tensors.

The two dispatcher subclasses change only where megatron's collectives allocate on
``torch.cuda.current_device()`` or use CUDA streams: they run the same collectives with the
output on the input's device (gloo on CPU, NCCL or gloo on GPU). gloo has ``all_to_all`` for
CPU tensors only, so on one GPU over gloo only the all-gather dispatcher runs.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from harts.errors import HartsError, ModelInputError
from harts.kernels import dispatch as kernel_dispatch
from harts.parallel.layers import to_megatron_projections
from harts.parallel.mappings import gather_rows, reduce_scatter_rows
from harts.runtime.config import HybridConfig
from harts.runtime.layers import MLP
from harts.runtime.moe import TopKRouter, configure_routing, router_statistics

__all__ = ["DISPATCHERS", "HartsMoELayer", "HartsRouter", "LocalExperts", "moe_transformer_config"]

#: The token dispatchers a HARTS MoE layer runs (megatron-core's ``moe_token_dispatcher_type``).
DISPATCHERS = ("allgather", "alltoall")


def moe_transformer_config(config: HybridConfig, *, tensor_parallel: int, expert_parallel: int,
                           dispatcher: str) -> TransformerConfig:
    """The megatron-core config of a HybridConfig's MoE layers (dropless top-k, no megatron aux loss)."""
    if dispatcher not in DISPATCHERS:
        raise HartsError(f"MoE token dispatcher must be one of {list(DISPATCHERS)}, got {dispatcher!r}")
    if config.num_experts % expert_parallel:
        raise HartsError(f"config field 'num_experts' = {config.num_experts} does not divide by the "
                         f"expert-parallel size {expert_parallel} (option '--ep')")
    return TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=tensor_parallel,  # unused: attention is HARTS'
        ffn_hidden_size=config.moe_intermediate_size, moe_ffn_hidden_size=config.moe_intermediate_size,
        num_moe_experts=config.num_experts, moe_router_topk=config.num_experts_per_tok,
        moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        tensor_model_parallel_size=tensor_parallel, expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1, sequence_parallel=tensor_parallel > 1, params_dtype=config.torch_dtype,
        use_cpu_initialization=True, perform_initialization=False, add_bias_linear=False, gated_linear_unit=True,
        moe_permute_fusion=False, bias_activation_fusion=False,
    )


class HartsRouter(Router):
    """megatron-core's router interface around the native router's code (module docstring).

    Per call the MoE layer sets :attr:`row_weight` (q of each token row, 0 for padding) and
    :attr:`replay` (routed expert ids [T, k] or None) and reads :attr:`statistics` back. The
    parameter (``weight`` [E, D]) and buffer (``e_score_correction_bias`` [E]) are the native
    router's, under the native names.
    """

    # The native router's routing, run on this module's attributes (no copy of its math).
    route_rows = TopKRouter.forward
    _select = TopKRouter._select
    _check_routed = TopKRouter._check_routed

    def __init__(self, config: TransformerConfig, pg_collection=None, is_mtp_layer: bool = False, *,
                 hybrid: HybridConfig):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        configure_routing(self, hybrid)
        self.row_weight: torch.Tensor | None = None
        self.replay: torch.Tensor | None = None
        self.statistics: tuple[torch.Tensor, ...] | None = None

    def routing(self, logits: torch.Tensor):  # noqa: D102 - megatron's abstract hook; forward routes
        raise NotImplementedError("HartsRouter routes in forward")

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):  # noqa: A002
        """input [T, D] -> (probs [T, E]: the combine weights at the routed experts, routing map [T, E] bool).

        ``padding_mask`` (megatron's) is not needed: padding rows carry ``row_weight`` 0.
        """
        if self.row_weight is None:
            raise HartsError("HartsRouter: the MoE layer sets row_weight before routing")
        replay = self.replay
        if replay is not None:
            self._check_distinct(replay)
        logits, probs, weights, indices = self.route_rows(input, replay)
        self.statistics = router_statistics(logits, probs, indices, self.row_weight)
        dense = weights.new_zeros(logits.shape).scatter(1, indices, weights)
        routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(1, indices, True)
        return dense, routing_map

    @staticmethod
    def _check_distinct(replay: torch.Tensor) -> None:
        """megatron's routing map holds one bit per (row, expert): a replayed row may not name an expert twice."""
        ordered = replay.sort(dim=1).values
        if replay.shape[1] > 1 and bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise ModelInputError("routed experts: a row names the same expert twice; the megatron-core MoE layer "
                                  "routes each row to distinct experts")


class LocalExperts(nn.Module):
    """This rank's SwiGLU experts in the native 3-D layout, on megatron's dispatched rows.

    ``forward(rows [T, D] sorted by local expert, tokens_per_expert [E / EP], probs [T])`` runs
    the native expert kernel (grouped GEMMs on CUDA, the per-expert reference elsewhere) with
    one local expert per row, weighted by its combine probability.
    """

    def __init__(self, num_local_experts: int, hybrid: HybridConfig):
        super().__init__()
        size = hybrid.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * size, hybrid.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hybrid.hidden_size, size))
        for parameter in (self.gate_up_proj, self.down_proj):
            parameter.allreduce = False  # megatron's mark of an expert parameter (reduced over expert-DP ranks)

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):  # noqa: D102
        counts = torch.as_tensor(tokens_per_expert, dtype=torch.long).to(rows.device)
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
        out = kernel_dispatch.moe_experts(rows, expert[:, None], probs.to(rows.dtype)[:, None],
                                          self.gate_up_proj, self.down_proj)
        return out, None

    def backward_dw(self) -> None:
        """megatron's delayed weight-gradient hook: weight gradients are computed in the backward."""


class RowGatherDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher, its row all-gather and reduce-scatter on the input's device."""

    def token_dispatch(self, hidden_states, probs):  # noqa: D102
        if self.tp_ep_group.size() > 1:
            with torch.no_grad():
                self.routing_map = gather_rows(self.routing_map, self.tp_ep_group)
            probs = gather_rows(probs, self.tp_ep_group)
            hidden_states = gather_rows(hidden_states, self.tp_ep_group)
        return hidden_states, probs

    def token_combine(self, hidden_states):  # noqa: D102
        if self.tp_ep_group.size() > 1:
            dtype = hidden_states.dtype
            hidden_states = reduce_scatter_rows(hidden_states.to(self.local_probs.dtype), self.tp_ep_group).to(dtype)
        return hidden_states


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` of rows with given splits, the output on the input's device; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        if group.size() == 1:
            return x
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAllRows.apply(grad, ctx.group, input_splits, output_splits), None, None, None


class _NoStream:
    """Stands for the device-to-host stream megatron's all-to-all dispatcher makes at construction,
    on a torch without CUDA (the split sizes are then read on the host directly)."""


class RowAllToAllDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher (permutations, chunk sorting, unpermute are megatron's) with its
    exchanges on the input's device and its split sizes read on the host without CUDA streams.

    Dropless routing only (HARTS drops no token) and expert tensor parallelism 1.
    """

    def __init__(self, *args, **kwargs):
        if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None and not torch.cuda.is_available():
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
        super().__init__(*args, **kwargs)

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """The exchange's split sizes: rows this rank sends to each EP rank, and receives from each for its experts."""
        sent = routing_map.sum(dim=0).long()  # [E] this rank's rows per expert
        self.num_out_tokens = routing_map.shape[0] * self.config.moe_router_topk
        every = gather_rows(sent[None], self.ep_group) if self.ep_size > 1 else sent[None]  # [EP, E]
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        to_local = every[:, first:last]  # [EP, E / EP]: rows each EP rank sends to each of this rank's experts
        self.input_splits = sent.view(self.ep_size, self.num_local_experts).sum(dim=1)
        self.output_splits = to_local.sum(dim=1)
        self.output_splits_tp = self.output_splits.sum().reshape(1)
        self.num_global_tokens_per_local_expert = to_local
        return to_local.sum(dim=0)

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        if point == "before_permutation_1":
            self.input_splits = self.input_splits.cpu().numpy()
            self.output_splits = self.output_splits.cpu().numpy()
            self.output_splits_tp = self.output_splits_tp.cpu().numpy()
            self.num_global_tokens_per_local_expert = self.num_global_tokens_per_local_expert.cpu()
            tokens_per_expert = tokens_per_expert.cpu()
        return tokens_per_expert

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):  # noqa: D102
        splits = (self.output_splits.tolist(), self.input_splits.tolist())
        return (_AllToAllRows.apply(permutated_local_input_tokens, self.ep_group, *splits),
                _AllToAllRows.apply(permuted_probs, self.ep_group, *splits))

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):  # noqa: D102
        return _AllToAllRows.apply(hidden_states, self.ep_group, self.input_splits.tolist(), self.output_splits.tolist())


class HartsMoELayer(MoELayer):
    """A HybridModel MoE FFN as megatron-core's ``MoELayer``: HARTS router and experts, a (TP-split) shared expert.

    ``forward(x [C' / TP, D] this rank's rows, row_weight [C' / TP], routed [C' / TP, k] or None,
    group)`` -> (y [C' / TP, D], (z_loss_sum, prob_mass [E], assign_count [E], tokens) of this
    rank's rows). Parameter names are the native ``SparseMoeBlock``'s (the router is ``gate``).
    """

    #: apply_expert_bias_update finds the routers of these blocks (see harts.runtime.moe).
    is_harts_moe_block = True

    def __init__(self, hybrid: HybridConfig, transformer_config: TransformerConfig, pg_collection, *,
                 dispatcher: str, parallel_config, tensor_group):
        def router(*, config, pg_collection, is_mtp_layer=False):
            return HartsRouter(config, pg_collection, is_mtp_layer, hybrid=hybrid)

        def experts(num_local_experts, config, *, pg_collection=None, name=None):
            return LocalExperts(num_local_experts, hybrid)

        # megatron's all-to-all dispatcher makes a CUDA stream at construction: build with the
        # all-gather one, then put the chosen HARTS dispatcher in its place.
        building = copy.copy(transformer_config)
        building.moe_token_dispatcher_type = "allgather"
        super().__init__(building, MoESubmodules(experts=experts, router=router), pg_collection=pg_collection)
        self.config = transformer_config
        kind = RowAllToAllDispatcher if dispatcher == "alltoall" else RowGatherDispatcher
        self.token_dispatcher = kind(self.num_local_experts, self.local_expert_indices, config=transformer_config,
                                     pg_collection=pg_collection)
        self.dispatcher = dispatcher
        self.tensor_group = tensor_group
        self.shared_expert = None
        if hybrid.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(hybrid.hidden_size, hybrid.shared_expert_intermediate_size)
            to_megatron_projections(self.shared_expert, parallel_config, tensor_group)
        self.shared_expert_gate = nn.Linear(hybrid.hidden_size, 1, bias=False) if hybrid.shared_expert_gate else None

    @property
    def gate(self) -> HartsRouter:
        """The router under the native name (expert-bias updates, state-dict names)."""
        return self.router

    def forward(self, x: torch.Tensor, row_weight: torch.Tensor, routed: torch.Tensor | None = None):  # noqa: D102
        rows = x.shape[0]
        x_in, row_weight, routed = self._equal_rows(x, row_weight, routed)
        self.router.row_weight, self.router.replay = row_weight, routed
        try:
            y, _ = super().forward(x_in)
            stats = self.router.statistics
        finally:
            self.router.row_weight = self.router.replay = self.router.statistics = None
        y = y[:rows]
        if self.shared_expert is not None:
            shared = self.shared_expert(gather_rows(x, self.tensor_group))
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        return y, stats

    def _equal_rows(self, x, row_weight, routed):
        """The all-gather dispatcher gathers equal row counts: pad to the largest in the expert-parallel group (weight 0)."""
        group = self.token_dispatcher.tp_ep_group
        if self.dispatcher != "allgather" or group.size() == 1:
            return x, row_weight, routed
        count = torch.tensor([x.shape[0]], device=x.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        extra = int(count) - x.shape[0]
        if extra == 0:
            return x, row_weight, routed
        x = torch.cat([x, x.new_zeros(extra, x.shape[1])])
        row_weight = torch.cat([row_weight, row_weight.new_zeros(extra)])
        if routed is not None:
            distinct = torch.arange(routed.shape[1], device=routed.device, dtype=routed.dtype)
            routed = torch.cat([routed, distinct.expand(extra, -1)])
        return x, row_weight, routed

