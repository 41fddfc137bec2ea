"""Training on compiled plans: the step API, data parallelism and the ``harts train`` loop.

    from harts.train import Trainer, TrainConfig

    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-5),
                      TrainConfig(algorithm="grpo", epochs=2, kl_coef=1e-3), reference_model=reference)
    result = trainer.step(batch, plan)            # mode="baseline": the same step trajectory-wise
    result.metrics[-1]["loss"], result.metrics[-1]["fbgrad_seconds"]

Under ``torchrun`` (or inside the caller's process group) each rank runs the microbatches
its replica owns; wrap the model in ``DistributedDataParallel`` or ``fully_shard`` first.
"""

from harts.train.config import ALGORITHMS, MODES, TrainConfig, TrainingError
from harts.train.distributed import ProcessGroupInfo, gradient_sync, replica_microbatches, wrap_model, wrapper_kind
from harts.train.trainer import NonFiniteStepError, StepResult, Trainer, train_step

__all__ = [
    "ALGORITHMS",
    "MODES",
    "ProcessGroupInfo",
    "StepResult",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "gradient_sync",
    "replica_microbatches",
    "train_step",
    "wrap_model",
    "wrapper_kind",
]
