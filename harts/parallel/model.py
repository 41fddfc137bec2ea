"""A megatron-core execution of :class:`~harts.runtime.HybridModel`: tensor and sequence parallelism.

Each rank of the tensor-parallel group holds ``1 / TP`` of every layer's heads (linear
attention: states ``[N, H / TP, K, V]`` in fp32, exported and injected per local head by the
rank's own execution view; the short convolution's channels; GQA / MLA heads; FFN channels)
and ``1 / TP`` of the vocabulary (``VocabParallelEmbedding``, the LM head's rows). Between
blocks the hidden rows are sequence-parallel: rank r keeps rows ``[r C' / TP, (r + 1) C' / TP)``
of the compact rows padded to ``C'``, a multiple of TP. Per block::

    h = gather_rows(input_layernorm(x))[:C]        # every rank: all C rows (the view needs them)
    x = x + mixer(h, view)                          # local heads; row projection reduce-scatters
    x = x + mlp(gather_rows(post_attention_layernorm(x)))

and the log-prob head (:mod:`harts.parallel.logprobs`) reads the gathered final rows with the
vocabulary shard. A MoE FFN is megatron-core's ``MoELayer`` (:mod:`harts.parallel.moe`): each
rank routes its own rows, and the all-gather or all-to-all token dispatcher brings them to
the ``E / EP`` experts of each expert-parallel rank. Parameter names equal the native model's; :meth:`from_model` slices a
single-process model's state dict (so TP = 1 is the native model, operation for operation)
and :meth:`full_state_dict` gathers it back in the native / Hugging Face layout.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from harts.errors import HartsError
from harts.numerics import compute_dtype
from harts.parallel.layers import keep_uninitialised, to_megatron_projections
from harts.parallel.logprobs import vocab_parallel_compact_log_probs
from harts.parallel.mappings import gather_rows, padded_rows, scatter_rows
from harts.parallel.moe import HartsMoELayer, HartsRouter, moe_transformer_config
from harts.runtime.config import HybridConfig
from harts.runtime.layers import KimiForgetGate, RMSNorm
from harts.runtime.model import DecoderLayer, HybridModel, run_blocks
from harts.runtime.moe import MoEStats, TopKRouter

__all__ = ["TensorParallelError", "TensorParallelHybridModel", "local_config"]


class TensorParallelError(HartsError, ValueError):
    """A model shape or setting the tensor-parallel layout cannot split."""


def local_config(config: HybridConfig, size: int) -> HybridConfig:
    """The config of one rank's layers: head and channel counts divided by the group size (routed experts stay whole;
    expert parallelism splits their number, see :mod:`harts.parallel.moe`)."""
    split = {
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for field, value in split.items():
        if value % size:
            raise TensorParallelError(f"config field '{field}' = {value} does not divide by the tensor-parallel size {size}")
    split.pop("vocab_size")
    return attrs.evolve(config, **{field: value // size for field, value in split.items()})


def _conv_segments(config: HybridConfig) -> list[int]:
    """The short convolution's channel blocks [q; k; v], each split by head."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return [key, key, config.linear_num_value_heads * config.linear_value_head_dim]


def _native_name(name: str) -> str:
    """The native / HF name of a parameter: megatron's ``MoELayer`` calls its router ``router``, HybridModel ``gate``."""
    return name.replace(".mlp.router.", ".mlp.gate.")


def _local_rows(values: torch.Tensor, padded: int, group, fill: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a per-row tensor [C, ...] padded to ``padded`` rows with ``fill`` (no gradient flows)."""
    if padded > values.shape[0]:
        values = torch.cat([values, fill.expand(padded - values.shape[0], *values.shape[1:])])
    return values.chunk(group.size(), dim=0)[group.rank()]


class ParallelDecoderLayer(DecoderLayer):
    """One rank's pre-norm block: the native block at the local head count, megatron projections, SP rows.

    A MoE FFN (``moe``: the full config, megatron's MoE config, its process groups and the
    dispatcher) is a :class:`~harts.parallel.moe.HartsMoELayer` routing only this rank's rows:
    the router is a replicated parameter (gradients summed over the group like the norms'),
    padding rows carry multiplicity 0 so that no router statistic counts them, and the
    statistics are summed over the group with megatron-core's
    ``reduce_from_tensor_model_parallel_region`` (its backward hands each rank the gradient of its rows).
    """

    def __init__(self, config: HybridConfig, layer_idx: int, parallel_config: ModelParallelConfig, group, moe=None):
        super().__init__(config, layer_idx)
        self.group = group
        to_megatron_projections(self.mixer, parallel_config, group)
        if self.mlp_type != "moe":
            to_megatron_projections(self.mlp, parallel_config, group)
        else:
            full, transformer_config, pg_collection, dispatcher = moe
            local = attrs.evolve(full, shared_expert_intermediate_size=config.shared_expert_intermediate_size)
            self.mlp = HartsMoELayer(local, transformer_config, pg_collection, dispatcher=dispatcher,
                                     parallel_config=parallel_config, tensor_group=group)

    def forward(self, x: torch.Tensor, view, routed_experts: torch.Tensor | None = None):
        """x [C' / TP, D] (this rank's rows) -> (x [C' / TP, D], MoE statistics summed over the group, or None)."""
        mixer_in = gather_rows(self.input_layernorm(x), self.group)[: view.num_rows]
        x = x + self.mixer(mixer_in, view)
        normed = self.post_attention_layernorm(x)
        if self.mlp_type != "moe":
            return x + self.mlp(gather_rows(normed, self.group)), None
        padded = x.shape[0] * self.group.size()
        weight = _local_rows(view.row_weight, padded, self.group, view.row_weight.new_zeros(()))
        routed = None
        if routed_experts is not None:
            replay = routed_experts[:, self.moe_index]
            distinct = torch.arange(replay.shape[1], device=replay.device, dtype=replay.dtype)
            routed = _local_rows(replay, padded, self.group, distinct)
        update, stats = self.mlp(normed, weight, routed)
        if self.group.size() > 1:
            stats = tuple(reduce_from_tensor_model_parallel_region(value.clone(), group=self.group) for value in stats)
        return x + update, stats


class TensorParallelHybridModel(nn.Module):
    """One tensor-parallel rank of a :class:`HybridModel` (see the module docstring).

    Args:
        config: the full model's config (head counts, FFN width and vocabulary divisible by TP;
            the number of experts by EP).
        group: the tensor-parallel process group (default: megatron-core's, from
            ``parallel_state``; torch.distributed must be initialised).
        token_dispatcher: the MoE layers' megatron-core token dispatcher, ``"allgather"`` or
            ``"alltoall"`` (gloo has all-to-all for CPU tensors only).

    Expert parameters (``*.mlp.experts.*``) hold this rank's ``E / EP`` experts (dim 0 split
    over megatron's expert-parallel group). torch DDP is told to leave them alone
    (``_ddp_params_and_buffers_to_ignore``): :meth:`finalize_gradients` sums their gradients
    over the expert-data-parallel group instead, as megatron's DDP does for its expert
    parameters (``allreduce = False``).
    """

    def __init__(self, config: HybridConfig, group=None, *, token_dispatcher: str = "allgather"):
        super().__init__()
        from megatron.core import parallel_state

        if group is None:
            group = parallel_state.get_tensor_model_parallel_group()
        if group is None:
            raise TensorParallelError("no tensor-parallel group: initialise torch.distributed and harts.parallel.initialize first")
        self.config = config
        self.tensor_parallel_group = group
        size = group.size()
        local = local_config(config, size)
        self.parallel_config = ModelParallelConfig(
            tensor_model_parallel_size=size, params_dtype=config.torch_dtype, use_cpu_initialization=True,
            perform_initialization=False,
        )
        moe = None
        if config.num_moe_layers:
            moe = self._moe_setup(config, size, token_dispatcher)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, init_method=keep_uninitialised,
                                                   config=self.parallel_config, tp_group=group)
        self.layers = nn.ModuleList(ParallelDecoderLayer(local, i, self.parallel_config, group, moe)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_zero_centered)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, config=self.parallel_config,
                                            init_method=keep_uninitialised, bias=False, gather_output=False,
                                            disable_grad_reduce=True, tp_group=group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.to(config.torch_dtype)
        keep = compute_dtype(config.torch_dtype)  # as HybridModel: decay biases and routers stay in at least float32
        for module in self.modules():
            if isinstance(module, KimiForgetGate):
                module.dt_bias.data = module.dt_bias.data.to(keep)
            elif isinstance(module, (TopKRouter, HartsRouter)):
                module.weight.data = module.weight.data.to(keep)
                if module.e_score_correction_bias is not None:
                    module.e_score_correction_bias = module.e_score_correction_bias.to(keep)
        #: Parameter name -> the dim its shard splits over the TP group (None: replicated on every rank).
        self.split_dims: dict[str, int | None] = {}
        #: Native names of the expert parameters (dim 0 split over the expert-parallel group).
        self.expert_names = frozenset(name for name in self._own_parameters() if ".mlp.experts." in name)
        self._ddp_params_and_buffers_to_ignore = sorted(self.expert_names)

    def _moe_setup(self, config: HybridConfig, size: int, token_dispatcher: str):
        """(config, megatron's MoE config, its process groups, dispatcher) for the MoE layers; the expert groups."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        if not parallel_state.model_parallel_is_initialized():
            raise TensorParallelError("a MoE model needs megatron-core's expert groups: call harts.parallel.initialize first")
        pg_collection = get_default_pg_collection()
        pg_collection.tp = self.tensor_parallel_group
        self.expert_parallel_group = pg_collection.ep
        self.expert_data_parallel_group = pg_collection.expt_dp
        self.data_parallel_size = parallel_state.get_data_parallel_world_size()
        transformer_config = moe_transformer_config(config, tensor_parallel=size, expert_parallel=pg_collection.ep.size(),
                                                    dispatcher=token_dispatcher)
        return config, transformer_config, pg_collection, token_dispatcher

    # ------------------------------------------------------------------ weights

    @property
    def tensor_parallel_rank(self) -> int:
        return self.tensor_parallel_group.rank()

    @property
    def tensor_parallel_size(self) -> int:
        return self.tensor_parallel_group.size()

    @property
    def expert_parallel_lockstep(self) -> bool:
        """Whether MoE layers exchange rows with other ranks: every rank must then run as many passes (harts.train)."""
        return self._expert_group_size() > 1

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def _segments(self, name: str) -> list[int] | None:
        return _conv_segments(self.config) if ".conv1d." in name else None

    def _split_dim(self, name: str, full: torch.Size, local: torch.Size) -> int | None:
        if full == local:
            return None
        dims = [d for d, (f, s) in enumerate(zip(full, local)) if f != s]
        size = self.tensor_parallel_size
        if len(full) != len(local) or len(dims) != 1 or full[dims[0]] != local[dims[0]] * size:
            raise TensorParallelError(f"parameter '{name}': shard {tuple(local)} is no 1/{size} split of {tuple(full)}")
        return dims[0]

    def _shard(self, name: str, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        size, rank = self.tensor_parallel_size, self.tensor_parallel_rank
        segments = self._segments(name) or [tensor.shape[dim]]
        pieces = [block.chunk(size, dim=dim)[rank] for block in tensor.split(segments, dim=dim)]
        return torch.cat(pieces, dim=dim)

    def _unshard(self, name: str, shard: torch.Tensor, dim: int) -> torch.Tensor:
        size = self.tensor_parallel_size
        shards = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(shards, shard.contiguous(), group=self.tensor_parallel_group)
        segments = [s // size for s in (self._segments(name) or [shard.shape[dim] * size])]
        per_rank = [piece.split(segments, dim=dim) for piece in shards]
        return torch.cat([per_rank[r][block] for block in range(len(segments)) for r in range(size)], dim=dim)

    def _own_parameters(self) -> dict[str, torch.Tensor]:
        """Native name -> this rank's tensor (parameters and buffers)."""
        return {_native_name(name): tensor for name, tensor in self.state_dict(keep_vars=True).items()
                if not name.endswith("_extra_state")}

    def native_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) under HybridModel's names (megatron's ``router`` is ``gate``), the names ``split_dims`` uses."""
        return [(_native_name(name), parameter) for name, parameter in self.named_parameters()]

    def _expert_group_size(self) -> int:
        return self.expert_parallel_group.size() if self.expert_names else 1

    def _expert_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(self._expert_group_size(), dim=0)[self.expert_parallel_group.rank()]

    def _expert_unshard(self, shard: torch.Tensor) -> torch.Tensor:
        if self._expert_group_size() == 1:
            return shard.clone()
        return gather_rows(shard.contiguous(), self.expert_parallel_group).clone()

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a single-process (native / HF layout) state dict: each rank keeps its shard (and its experts)."""
        own = self._own_parameters()
        missing = sorted(set(own) - set(state))
        if missing:
            raise TensorParallelError(f"the state dict lacks parameter(s) {missing[:5]}")
        for name, target in own.items():
            full = state[name]
            if name in self.expert_names:
                target.copy_(self._expert_shard(full))
                self.split_dims[name] = None
                continue
            dim = self._split_dim(name, full.shape, target.shape)
            target.copy_(full if dim is None else self._shard(name, full, dim))
            self.split_dims[name] = dim
            if dim is not None and not getattr(target, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(target, True, dim, 1)

    @classmethod
    def from_model(cls, model: HybridModel, group=None, *, token_dispatcher: str = "allgather") -> TensorParallelHybridModel:
        """This rank's shard of ``model`` (the same weights on every rank), on ``model``'s device."""
        parallel = cls(model.config, group, token_dispatcher=token_dispatcher).to(model.device)
        parallel.load_full_state_dict(model.state_dict())
        return parallel

    def _gathered(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self.expert_names:
            return self._expert_unshard(tensor)
        dim = self.split_dims.get(name)
        return tensor.clone() if dim is None else self._unshard(name, tensor, dim)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict in the native / HF layout, on every rank (shards all-gathered)."""
        return {name: self._gathered(name, tensor.detach()) for name, tensor in self._own_parameters().items()}

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient in the native layout (call after :meth:`finalize_gradients`)."""
        return {name: None if parameter.grad is None else self._gathered(name, parameter.grad)
                for name, parameter in self.native_named_parameters()}

    def to_hybrid_model(self) -> HybridModel:
        """A single-process :class:`HybridModel` with the gathered weights (on every rank)."""
        model = HybridModel(self.config).to(self.device)
        model.load_state_dict(self.full_state_dict())
        return model

    # ------------------------------------------------------------------ gradients

    def finalize_gradients(self) -> None:
        """Sum the replicated parameters' gradients over the TP group (each rank saw its rows or heads only),
        and the experts' over the expert-data-parallel group.

        An expert's gradient on its rank already sums every row the dispatcher brought it from the
        expert-parallel group; the ranks holding the same experts saw the other rows. The sum is
        divided by the data-parallel size, the mean torch DDP takes of the other parameters (the
        trainer scales each rank's loss by that size).
        """
        for name, parameter in self.native_named_parameters():
            if name in self.expert_names:
                if parameter.grad is None:  # no row reached these experts here; the group's sum needs every rank
                    parameter.grad = torch.zeros_like(parameter)
                if self.expert_data_parallel_group.size() > 1:
                    dist.all_reduce(parameter.grad, group=self.expert_data_parallel_group)
                if self.data_parallel_size > 1:
                    parameter.grad.div_(self.data_parallel_size)
            elif self.tensor_parallel_size > 1 and parameter.grad is not None and self.split_dims.get(name) is None:
                dist.all_reduce(parameter.grad, group=self.tensor_parallel_group)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The whole model's gradient 2-norm (shards summed over their group, replicas once), clipped to ``max_norm``."""
        grads = [(name, p.grad) for name, p in self.native_named_parameters() if p.grad is not None]
        dtype = torch.float64 if any(g.dtype == torch.float64 for _, g in grads) else torch.float32
        sharded, replicated, experts = (torch.zeros((), dtype=dtype, device=self.device) for _ in range(3))
        for name, grad in grads:
            square = grad.detach().to(dtype).pow(2).sum()
            if name in self.expert_names:
                experts += square
            elif self.split_dims.get(name) is None:
                replicated += square
            else:
                sharded += square
        if self.tensor_parallel_size > 1:
            dist.all_reduce(sharded, group=self.tensor_parallel_group)
        if self._expert_group_size() > 1:
            dist.all_reduce(experts, group=self.expert_parallel_group)
        norm = (sharded + replicated + experts).sqrt()
        coefficient = float(max_norm) / (float(norm) + 1e-6)
        if coefficient < 1.0:
            for _, grad in grads:
                grad.mul_(coefficient)
        return norm

    # ------------------------------------------------------------------ forward

    def forward_hidden(self, input_ids: torch.Tensor, view, *, recompute: bool = False, routed_experts=None):
        """input_ids [C], routed_experts [C, L_moe, k] or None -> (final hidden rows [C, D] and the MoE statistics, the same on every rank)."""
        if input_ids.dim() != 1 or input_ids.shape[0] != view.num_rows:
            raise ValueError(f"input_ids must be [C] with C = {view.num_rows} rows, got shape {tuple(input_ids.shape)}")
        rows = view.num_rows
        ids = F.pad(input_ids, (0, padded_rows(rows, self.tensor_parallel_size) - rows))
        if routed_experts is not None:
            expected = (rows, self.config.num_moe_layers, self.config.num_experts_per_tok)
            if tuple(routed_experts.shape) != expected:
                raise ValueError(f"routed_experts must have shape [rows, MoE layers, top_k] = {list(expected)}, "
                                 f"got {list(routed_experts.shape)}")
        x = scatter_rows(self.embed_tokens(ids), self.tensor_parallel_group)
        x, per_layer = run_blocks(self.layers, x, view, routed_experts, recompute)
        hidden = gather_rows(self.norm(x), self.tensor_parallel_group)[:rows]
        moe = MoEStats.stack(per_layer, rows if per_layer else 0, self.config.num_experts, device=hidden.device,
                             dtype=compute_dtype(hidden.dtype))
        return hidden, moe

    def head_log_probs(self, hidden, rows, targets, *, with_entropy=False, row_chunk=None, temperature=1.0):
        """Per-position log-probs (and entropies) of compact rows, the LM head vocab-parallel (Eq. 17-19)."""
        weight = self.lm_head.weight if temperature == 1.0 else self.lm_head.weight / temperature
        shard = weight.shape[0]
        return vocab_parallel_compact_log_probs(
            hidden, weight, None, rows, targets, vocab_start=self.tensor_parallel_rank * shard,
            vocab_size=self.config.vocab_size, group=self.tensor_parallel_group, with_entropy=with_entropy,
            row_chunk=row_chunk,
        )

    def forward(self, input_ids, view, *, recompute=False, routed_experts=None, head=None):
        """As :meth:`HybridModel.forward` with a ``head`` (the runtime's log-prob program): (head output, MoE fields)."""
        if head is None:
            raise TensorParallelError("the tensor-parallel model computes no [C, V] logits; call it with a log-prob head")
        hidden, moe = self.forward_hidden(input_ids, view, recompute=recompute, routed_experts=routed_experts)
        return head(self, hidden), attrs.astuple(moe, recurse=False)
