"""megatron-core's data parallelism under :class:`harts.train.Trainer`: its ``DistributedDataParallel``,
``finalize_model_grads`` and distributed optimizer (``get_megatron_optimizer``).

    model = harts.parallel.TensorParallelHybridModel.from_model(native)     # after harts.parallel.initialize
    wrapped = harts.parallel.optim.wrap_megatron(model)                       # megatron DDP over its DP group
    optimizer = harts.parallel.optim.megatron_optimizer(wrapped, lr=1e-5, weight_decay=0.1, max_grad_norm=1.0)
    trainer = harts.train.Trainer(wrapped, optimizer, config, process_group=layout.data_parallel_group)

What each piece does for a HARTS step (the plan's DP replicas are megatron's data-parallel ranks,
:mod:`harts.parallel.state`):

- megatron DDP accumulates every parameter's gradient into a contiguous fp32 buffer
  (``param.main_grad``; ``grad_reduce_in_fp32``) and reduces it once per optimizer step, over the
  data-parallel group (reduce-scatter with the distributed optimizer, all-reduce without), scaled
  by ``1 / DP`` like torch DDP: the trainer's loss scaling by the DP size holds for both. Expert
  parameters (megatron marks them ``allreduce = False``) sit in their own buffers, reduced over the
  expert-data-parallel group with the same ``1 / DP`` scale.
- ``finalize_model_grads`` runs that reduction, then sums over the tensor-parallel group the
  gradients of parameters marked ``sequence_parallel``. :func:`mark_tensor_parallel_replicas`
  marks exactly the parameters that :meth:`TensorParallelHybridModel.finalize_gradients` sums (the
  replicated ones: each TP rank saw only its rows or heads), so the trainer skips HARTS' own sum on
  this path and nothing is counted twice. Expert parameters are not marked: their
  expert-data-parallel group already spans the TP ranks that routed other rows.
- the distributed optimizer keeps fp32 master weights and Adam moments for this rank's
  ``1 / DP`` of every buffer; it measures the whole model's gradient norm (TP shards once,
  replicas once), the trainer clips by it, and its step all-gathers the updated parameters.

CUDA only. Measured on megatron-core 0.19.2's source: ``_ParamAndGradBuffer`` allocates its
``grad_data`` / ``param_data`` with ``device=torch.cuda.current_device()`` (no device argument),
``start_grad_sync`` reads ``torch.cuda.current_stream()`` on every reduction, the gradient-norm and
clipping code (``optimizer/clip_grads.py``) allocate ``device='cuda'`` tensors and assert
``torch.cuda.FloatTensor`` gradients, and the optimizers sort parameters by ``param.type()`` among
``torch.cuda.*Tensor`` names (a CPU tensor is refused). On the CPU :func:`~harts.train.distributed.refuse_megatron_off_cuda`
refuses it with a :class:`~harts.train.TrainingError`; the CPU path is torch DDP (``--dp-engine torch``).
Over gloo megatron's reductions run inside ``torch.distributed._coalescing_manager``, whose
coalesced all-reduce gloo implements for CPU tensors only: several ranks need NCCL, one GPU each.
"""

from __future__ import annotations

import attrs
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.transformer.transformer_config import TransformerConfig

from harts.parallel.model import TensorParallelHybridModel
from harts.train.config import TrainingError
from harts.train.distributed import refuse_megatron_off_cuda

__all__ = [
    "MegatronDataParallelOptions",
    "MegatronStepper",
    "ddp_config",
    "mark_tensor_parallel_replicas",
    "megatron_optimizer",
    "optimizer_config",
    "transformer_config",
    "wrap_megatron",
]


@attrs.frozen(kw_only=True)
class MegatronDataParallelOptions:
    """How megatron DDP reduces gradients.

    ``distributed_optimizer``: shard the optimizer state over the data-parallel ranks (the
    gradients are reduce-scattered, the parameters all-gathered after the step).
    ``overlap_grad_reduce``: start each bucket's reduction during the last microbatch's backward
    (off: one reduction after it, which every parameter joins whether or not it got a gradient,
    as MoE experts that no row reached). ``bucket_size``: elements per bucket when overlapping
    (None: megatron's ``max(40M, 1M x DP)``); without overlap each buffer is one bucket.
    """

    distributed_optimizer: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    overlap_grad_reduce: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    bucket_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(int)))


def transformer_config(module: TensorParallelHybridModel) -> TransformerConfig:
    """The megatron ``TransformerConfig`` DDP and ``finalize_model_grads`` read: the parallel layout and dtypes.

    HARTS' layers never read it. ``sequence_parallel`` is on under TP > 1 because that is the
    switch for ``finalize_model_grads``' TP sum of the parameters marked ``sequence_parallel``.
    """
    hybrid = module.config
    size = module.tensor_parallel_size
    return TransformerConfig(
        num_layers=hybrid.num_layers, hidden_size=hybrid.hidden_size, num_attention_heads=hybrid.num_attention_heads,
        tensor_model_parallel_size=size, sequence_parallel=size > 1, params_dtype=module.dtype,
        bf16=module.dtype == torch.bfloat16, fp16=module.dtype == torch.float16,
    )


def ddp_config(options: MegatronDataParallelOptions | None = None) -> DistributedDataParallelConfig:
    """megatron DDP's config: fp32 gradient reduction, a sum of ``1 / DP``-scaled gradients (gloo has no AVG)."""
    options = options or MegatronDataParallelOptions()
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=options.overlap_grad_reduce, overlap_param_gather=False,
        use_distributed_optimizer=options.distributed_optimizer, bucket_size=options.bucket_size,
        average_in_collective=False,
    )


def mark_tensor_parallel_replicas(module: TensorParallelHybridModel) -> list[str]:
    """Mark (``sequence_parallel = True``) the parameters whose gradients ``finalize_model_grads`` sums over TP.

    The same rule as :meth:`TensorParallelHybridModel.finalize_gradients`: every parameter
    replicated on the TP ranks, apart from megatron's expert parameters (``allreduce = False``).
    Returns the marked names.
    """
    unknown = [name for name, _ in module.native_named_parameters() if name not in module.split_dims]
    if unknown:
        raise TrainingError(
            f"parameter(s) {unknown[:3]} have no known tensor-parallel split: load the weights with "
            "TensorParallelHybridModel.from_model or load_full_state_dict before wrapping the model"
        )
    marked = []
    for name, parameter in module.native_named_parameters():
        if module.split_dims[name] is None and getattr(parameter, "allreduce", True):
            parameter.sequence_parallel = True
            marked.append(name)
    return marked


def wrap_megatron(module: TensorParallelHybridModel, options: MegatronDataParallelOptions | None = None) -> DistributedDataParallel:
    """``module`` in megatron's ``DistributedDataParallel`` over megatron's data-parallel group (CUDA)."""
    if not isinstance(module, TensorParallelHybridModel):
        raise TrainingError(f"megatron DDP wraps a harts.parallel.TensorParallelHybridModel, got {type(module).__name__}")
    refuse_megatron_off_cuda(module.device, "harts.parallel.optim.wrap_megatron")
    mark_tensor_parallel_replicas(module)
    return DistributedDataParallel(transformer_config(module), ddp_config(options), module)


def optimizer_config(*, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                     max_grad_norm: float | None = 1.0, params_dtype: torch.dtype = torch.float32,
                     distributed: bool = True) -> OptimizerConfig:
    """megatron's ``OptimizerConfig`` for HARTS' AdamW options (:func:`harts.train.loop.make_optimizer`).

    Decoupled weight decay (AdamW); ``clip_grad`` 0 means no clipping (``max_grad_norm`` None);
    bf16 parameters get fp32 master weights (``bf16``), fp32 ones are their own master weights.
    fp16 needs a loss scaler, which HARTS' step does not run.
    """
    if params_dtype == torch.float16:
        raise TrainingError("megatron's optimizer trains float16 parameters with loss scaling, which HARTS' step does not "
                            "run; use bfloat16 or float32")
    if not (len(betas) == 2 and all(0.0 <= beta < 1.0 for beta in betas)):
        raise TrainingError(f"Adam betas must be two numbers in [0, 1), got {betas!r}")
    return OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1],
        adam_eps=eps, decoupled_weight_decay=True, clip_grad=0.0 if max_grad_norm is None else float(max_grad_norm),
        bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype, use_distributed_optimizer=distributed,
        main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
    )


def megatron_optimizer(wrapped: DistributedDataParallel, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                       eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0) -> MegatronOptimizer:
    """``get_megatron_optimizer`` over the megatron-wrapped model (distributed if its DDP config says so).

    ``config_overrides={}``: weight decay on every parameter, as the torch AdamW of the torch
    path; megatron's standard overrides would exempt biases and 1-D parameters.
    """
    if not isinstance(wrapped, DistributedDataParallel):
        raise TrainingError(f"megatron's optimizer needs the model wrapped by wrap_megatron, got {type(wrapped).__name__}")
    config = optimizer_config(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                              params_dtype=wrapped.module.dtype, distributed=wrapped.ddp_config.use_distributed_optimizer)
    return get_megatron_optimizer(config, [wrapped], config_overrides={}, use_gloo_process_groups=False)


class MegatronStepper:
    """The trainer's gradient reduction, norm, clipping and step on megatron's DDP and optimizer.

    Split like the torch path so that the trainer can refuse a non-finite step before any weight
    moves: :meth:`gradient_norm` reduces (``finalize_model_grads``), hands the optimizer its
    gradients and measures them; :meth:`clip_and_step` clips by that norm (megatron's
    ``clip_grad_by_total_norm_fp32``, with the step's own ``max_grad_norm``) and steps.
    """

    def __init__(self, model: DistributedDataParallel, optimizer: MegatronOptimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def gradient_norm(self) -> float:
        finalize_model_grads([self.model])
        self.optimizer.prepare_grads()  # copies the reduced gradients to the master weights; no loss scaler runs
        return float(self.optimizer.get_grad_norm())

    def clip_and_step(self, norm: float, max_norm: float | None) -> None:
        if max_norm is not None:
            clip_grad_by_total_norm_fp32(self.optimizer.get_parameters(), max_norm, norm)
        self.optimizer.step_with_ready_grads()
