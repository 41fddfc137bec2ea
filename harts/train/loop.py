"""The loop behind ``harts train``: compile a rollout batch once, then run RL steps on it.

Options come from :class:`RunOptions` (the CLI flags, a YAML file, or both; flags win). The
model is built from a preset or a Hugging Face checkpoint after seeding torch, so runs with
one seed start from the same weights in either mode. Under ``torchrun`` every rank joins the
process group, builds the same model and plan, wraps the model (DDP or FSDP2) and runs its
replica's microbatches; rank 0 shows progress and writes the metrics, plot and weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from harts._version import __version__
from harts.errors import OutputError
from harts.options import DEFAULT_OPTIONS, MAX_CAPACITY, MAX_CHUNK_SIZE
from harts.train.config import MAX_SEED, OptionRule, TrainConfig, TrainingError, option_problem
from harts.train.distributed import DP_ENGINES, dp_engine, init_from_environment, is_megatron_wrapper, wrap_model
from harts.train.trainer import Trainer

logger = logging.getLogger(__name__)

__all__ = ["CLI_TRAIN_DEFAULTS", "MetricsFile", "RunOptions", "TrainingRun", "build_model", "check_run_outputs", "load_options",
           "make_optimizer", "run_training", "save_weights", "training_advantages"]

#: Where ``harts train`` departs from :class:`TrainConfig`'s defaults: a GRPO loop as RL
#: trainers run it (two epochs per batch, KL to the initial policy, expert-bias balancing).
CLI_TRAIN_DEFAULTS: dict[str, Any] = {"epochs": 2, "kl_coef": 1e-3, "expert_bias_rate": 1e-3}


#: torch.set_float32_matmul_precision's settings.
MATMUL_PRECISIONS = ("highest", "high", "medium")


def _text(optional: bool = True, choices: tuple[str, ...] | None = None) -> OptionRule:
    return OptionRule("text", optional=optional, choices=choices)


_path = OptionRule("path", optional=True)


def _mapping(instance, attribute, value) -> None:
    if not isinstance(value, Mapping):
        raise TrainingError(f"{type(instance).__name__}.{attribute.name} must be a mapping of model config fields, got {value!r}")


@attrs.frozen(kw_only=True)
class RunOptions:
    """Everything ``harts train`` needs; ``train`` holds the step's :class:`TrainConfig`."""

    input: str | os.PathLike | None = attrs.field(default=None, validator=_path)
    task: str | None = attrs.field(default=None, validator=_text())  # an online RL task (harts.tasks): see harts.train.online
    both_modes: bool = attrs.field(default=False, validator=OptionRule("bool"))  # --mode both (tasks only)
    preset: str = attrs.field(default="tiny", validator=_text(optional=False))
    hf: str | os.PathLike | None = attrs.field(default=None, validator=_path)
    model: Mapping[str, Any] = attrs.field(factory=dict, validator=_mapping)  # preset overrides, e.g. {"num_layers": 2}
    steps: int = attrs.field(default=3, validator=OptionRule("int", minimum=1))
    lr: float = attrs.field(default=1e-4, validator=OptionRule("number", above=0.0))
    weight_decay: float = attrs.field(default=0.0, validator=OptionRule("number", minimum=0.0))
    adam_eps: float | None = attrs.field(default=None, validator=OptionRule("number", above=0.0, optional=True))  # None: 1e-8
    dtype: str | None = attrs.field(default=None, validator=_text())
    seed: int = attrs.field(default=0, validator=OptionRule("int", minimum=0, maximum=MAX_SEED))
    capacity: int = attrs.field(default=65536, validator=OptionRule("int", minimum=1, maximum=MAX_CAPACITY))
    chunk_size: int = attrs.field(default=DEFAULT_OPTIONS.chunk_size,
                                  validator=OptionRule("int", minimum=1, maximum=MAX_CHUNK_SIZE))  # the plan's B
    dp: int | None = attrs.field(default=None, validator=OptionRule("int", minimum=1, optional=True))
    parallel: str = attrs.field(default="ddp", validator=_text(optional=False, choices=("ddp", "fsdp")))
    tp: int = attrs.field(default=1, validator=OptionRule("int", minimum=1))  # tensor parallel on megatron-core (harts.parallel)
    ep: int = attrs.field(default=1, validator=OptionRule("int", minimum=1))  # expert parallel on megatron-core
    # megatron-core's MoE token dispatcher (harts.parallel.moe): allgather or alltoall
    moe_dispatcher: str = attrs.field(default="allgather", validator=_text(optional=False, choices=("allgather", "alltoall")))
    # data parallelism on megatron-core's layout: "megatron" (its DDP + distributed optimizer, CUDA) or
    # "torch" (torch DDP + AdamW); None: megatron with --tp / --ep on CUDA, torch otherwise
    dp_engine: str | None = attrs.field(default=None, validator=_text(choices=DP_ENGINES))
    metrics: str | os.PathLike | None = attrs.field(default=None, validator=_path)
    plot: str | os.PathLike | None = attrs.field(default=None, validator=_path)
    save: str | os.PathLike | None = attrs.field(default=None, validator=_path)
    # torch.set_float32_matmul_precision for the run; None: "high" (TF32) on CUDA, "highest" elsewhere
    matmul_precision: str | None = attrs.field(default=None, validator=_text(choices=MATMUL_PRECISIONS))
    train: TrainConfig = attrs.field(factory=lambda: TrainConfig(**CLI_TRAIN_DEFAULTS))


_RUN_FIELDS = tuple(f.name for f in attrs.fields(RunOptions) if f.name != "train")


def _yaml_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"key {key!r} is given twice (first {seen[key]}); give each option once", key_node.start_mark)
                seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        document = yaml.load(path.read_text(), Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except OSError as error:
        raise TrainingError(f"config {path}: cannot be read ({error.strerror or error})") from error
    except UnicodeDecodeError as error:
        raise TrainingError(f"config {path}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    except yaml.YAMLError as error:
        raise TrainingError(f"config {path}: not valid YAML ({' '.join(str(error).split())})") from error
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise TrainingError(f"config {path}: expected a mapping of option names to values, got {type(document).__name__}")
    return document


def _coerce(value: Any, declared: str, source: str) -> Any:
    """YAML reads ``1e-3`` as a string (it wants ``1.0e-3``): numbers are parsed by the option's declared type."""
    kind = declared.split("|")[0].strip()
    if kind not in ("int", "float") or (value is None and "None" in declared):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TrainingError(f"{source} must be {'an int' if kind == 'int' else 'a number'}, got {value!r}")
    try:
        number = float(value) if kind == "float" else int(value)
    except (ValueError, OverflowError) as error:  # OverflowError: int(inf)
        raise TrainingError(f"{source} must be {'an int' if kind == 'int' else 'a number'}, got {value!r}") from error
    if kind == "int" and isinstance(value, float) and value != number:
        raise TrainingError(f"{source} must be an int, got {value!r}")
    return number


def _refuse_unknown(values: Mapping[str, Any], sources: Mapping[str, str], known: list[str]) -> None:
    """An unknown option is refused, with the closest known one when it looks like a typo."""
    import difflib

    for name in sorted(set(values) - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; options: {', '.join(known)}"
        raise TrainingError(f"{sources[name]} is unknown{hint}")


#: Options that the first one makes meaningless: given together they are refused, never silently dropped.
_CONFLICTS = (
    ("hf", "preset", "a --hf checkpoint brings its own architecture; give --preset or --hf, not both"),
    ("task", "dp", "an online task runs on one process and plans each step for it; --dp applies to a fixed batch"),
    ("task", "dp_engine", "an online task runs on one process; --dp-engine picks the data parallelism of a megatron-core layout"),
)


def _refuse_conflicts(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    for first, second, why in _CONFLICTS:
        if values.get(first) is not None and values.get(second) is not None:
            raise TrainingError(f"{sources[first]} and {sources[second]} do not go together: {why}")


def load_options(flags: Mapping[str, Any], config: str | os.PathLike | None = None) -> RunOptions:
    """Options from a YAML file (keys: option names, ``-`` or ``_``) overridden by ``flags`` (None: not given)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config is not None:
        for key, value in _read_yaml(Path(config)).items():
            name = str(key).replace("-", "_")
            values[name] = value
            sources[name] = f"config {config}: option '{key}'"
    for key, value in flags.items():
        if value is not None:
            values[key] = value
            sources[key] = f"option --{key.replace('_', '-')}"
    _refuse_conflicts(values, sources)
    if values.get("mode") == "both":
        if not values.get("task"):
            raise TrainingError(f"{sources['mode']}: 'both' runs HARTS and the baseline side by side on an online task; give --task")
        del values["mode"]
        values["both_modes"] = True
        sources["both_modes"] = sources.pop("mode")
    if values.get("task"):
        from harts.tasks import get_task

        # the task's own defaults (steps, learning rate, dtype, ...) sit under the file and the flags
        for key, value in get_task(str(values["task"])).defaults.items():
            if key not in values:
                values[key] = value
                sources[key] = f"task {values['task']!r}: default '{key}'"
    train_fields = set(TrainConfig.field_names())
    _refuse_unknown(values, sources, sorted(set(_RUN_FIELDS) | train_fields))
    declared = {f.name: str(f.type) for f in (*attrs.fields(RunOptions), *attrs.fields(TrainConfig))}
    for name, value in values.items():
        values[name] = _coerce(value, declared[name], sources[name])
        problem = option_problem(TrainConfig if name in train_fields else RunOptions, name, values[name])
        if name == "model" and not isinstance(values[name], Mapping):
            problem = f"must be a mapping of model config fields (e.g. num_layers: 2), got {values[name]!r}"
        if problem is not None:
            raise TrainingError(f"{sources[name]} {problem}")
    train_values = {**CLI_TRAIN_DEFAULTS, **{k: v for k, v in values.items() if k in train_fields}}
    run_values = {k: v for k, v in values.items() if k in _RUN_FIELDS}
    if run_values.get("hf") and run_values.get("model"):
        raise TrainingError("model overrides apply to presets; a --hf checkpoint brings its own config")
    return RunOptions(**run_values, train=TrainConfig(**train_values))


def training_advantages(batch) -> Any:
    """The batch's advantages, else GRPO group-relative ones from its ``reward`` field (groups: ``group_id``, else trees)."""
    from harts.rl import ADVANTAGE_FIELDS, group_advantages, metadata_field

    given = metadata_field(None, batch, ADVANTAGE_FIELDS, "advantages")
    if given is not None:
        return given
    if "reward" not in batch.trajectory_fields:
        raise TrainingError("the batch has neither advantages ('advantages' / 'advantage') nor rewards ('reward') to train on")
    groups = batch.trajectory_fields.get("group_id", np.asarray(batch.tree_ids))
    return group_advantages(batch.trajectory_fields["reward"], groups)


def make_optimizer(model, options: RunOptions):
    """AdamW over the model's parameters with the run's learning rate, weight decay and eps (megatron-core's
    distributed one, with the step's gradient clipping, for a model in megatron-core's DDP)."""
    extra = {} if options.adam_eps is None else {"eps": options.adam_eps}
    if is_megatron_wrapper(model):
        from harts.parallel.optim import megatron_optimizer

        return megatron_optimizer(model, lr=options.lr, weight_decay=options.weight_decay,
                                  max_grad_norm=options.train.max_grad_norm, **extra)
    return torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay, **extra)


def build_model(options: RunOptions, batch, device: torch.device | str = "cpu"):
    """The model to train, seeded with ``options.seed`` (same weights for either mode and on every rank)."""
    from harts.runtime import HybridConfig, HybridModel

    torch.manual_seed(options.seed)
    if options.hf is not None:
        from harts.models import from_hf

        model = from_hf(options.hf, dtype=options.dtype)
    else:
        overrides = dict(options.model)
        if options.dtype is not None:
            overrides["dtype"] = options.dtype
        if "vocab_size" not in overrides:
            from harts.runtime.config import PRESETS

            needed = int(max(int(t.max()) for t in batch.tokens)) + 1
            overrides["vocab_size"] = max(needed, int(PRESETS.get(options.preset, {}).get("vocab_size", needed)))
        model = HybridModel(HybridConfig.preset(options.preset, **overrides))
    return model.to(device)


def _full_state_dict(model) -> dict[str, torch.Tensor]:
    """Unsharded copies of every parameter and buffer (a collective under FSDP2: call on every rank)."""
    from harts.runtime.api import unwrap_model

    inner = unwrap_model(model)
    if hasattr(inner, "full_state_dict"):  # a tensor-parallel model (harts.parallel) gathers its shards
        return {name: value.to("cpu").contiguous() for name, value in inner.full_state_dict().items()}
    state = {}
    for name, value in inner.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        state[name] = value.detach().to("cpu").clone().contiguous()
    return state


def save_weights(model, path: str | os.PathLike, *, rank: int = 0, option: str | None = None) -> Path | None:
    """Write the model's weights as safetensors (atomically, rank 0; every rank must call under FSDP2).

    ``path`` must be new or weights HARTS wrote (:data:`harts.fsio.WEIGHTS`, marked in the file's
    metadata); anything else raises :class:`~harts.errors.OutputError` and is left untouched.
    """
    from safetensors.torch import save

    from harts.fsio import ARTIFACT_KEY, WEIGHTS, atomic_write_bytes, check_output

    state = _full_state_dict(model)  # a collective under FSDP2: every rank gets here before rank 0 may refuse
    if rank != 0:
        return None
    check_output(path, WEIGHTS, option=option)
    data = save(state, metadata={"format": "pt", ARTIFACT_KEY: "weights", "harts_version": __version__})
    try:
        return atomic_write_bytes(path, data)
    except OSError as error:
        raise OutputError(f"{option or 'cannot write the weights to'} {path}: {error.strerror or error}") from error


def _json_ready(record: Mapping[str, Any]) -> dict[str, Any]:
    """JSON has no inf/nan: such figures are written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


class MetricsFile:
    """Appends one JSON object per optimizer step to a ``.jsonl`` file, each record whole or not at all.

    The file must be new or one HARTS appended to (every record carries the
    :data:`harts.fsio.METRICS_MARKER` key); see :class:`harts.fsio.RecordAppender`.
    """

    def __init__(self, path: str | os.PathLike, *, option: str | None = None) -> None:
        from harts.fsio import METRICS, RecordAppender

        self.path = Path(path)
        self._appender = RecordAppender(self.path, METRICS, option=option)

    def write(self, record: Mapping[str, Any]) -> None:
        from harts.fsio import metrics_line

        self._appender.append(metrics_line(_json_ready(record)))

    def close(self) -> None:
        self._appender.close()


def check_run_outputs(options: RunOptions, *, config: str | os.PathLike | None = None) -> None:
    """Apply the output-ownership rule (:func:`harts.fsio.check_outputs`) to a run's --metrics, --plot and --save,
    before any work: each must be new or HARTS's own of its kind, apart from the others and from the run's inputs."""
    from harts.fsio import METRICS, PNG, WEIGHTS, check_outputs
    from harts.rollouts.inputs import input_path

    inputs = [None if options.input is None else input_path(options.input), options.hf, config]
    check_outputs([("--metrics", options.metrics, METRICS), ("--plot", options.plot, PNG), ("--save", options.save, WEIGHTS)],
                  inputs)


@contextlib.contextmanager
def step_progress(enabled: bool, console=None) -> Iterator[Callable[..., Any]]:
    """A rich progress display: ``update(title, phase, done, total, note="")`` redraws one bar per step."""
    if not enabled:
        yield lambda *args, **kwargs: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]{task.fields[title]}[/bold] {task.description:<20}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=console,
    )
    tasks: dict[str, Any] = {}

    def update(title: str, phase: str, done: int, total: int, note: str = "") -> None:
        if title not in tasks:
            tasks[title] = progress.add_task(phase, total=total, title=title, note=note)
        progress.update(tasks[title], description=phase, completed=done, total=total, note=note)

    with progress:
        yield update


@attrs.frozen(eq=False)
class TrainingRun:
    """What :func:`run_training` did: one record per optimizer step, the plan's statistics, the model."""

    records: tuple[dict[str, Any], ...]
    plan_stats: dict[str, Any]
    model_description: str
    world_size: int
    rank: int


def _parallel_model(model, reference, options: RunOptions, group, device):
    """(model to train, reference model, data-parallel degree, data-parallel group) for the run's layout.

    Without ``--tp`` / ``--ep`` (and ``--dp-engine megatron``): the model whole on every rank, wrapped by
    ``--parallel``, every rank a DP replica. With them: megatron-core's layout (harts.parallel), each rank
    this model's tensor-parallel shard and its experts, the DP replicas megatron's data-parallel ranks, under
    megatron-core's DDP and distributed optimizer (``--dp-engine megatron``, the default on CUDA) or torch
    DDP over their group (expert gradients then summed over the expert-data-parallel group by the model).
    """
    engine = dp_engine(options.dp_engine, tp=options.tp, ep=options.ep, device=device)
    if options.tp == 1 and options.ep == 1 and engine == "torch":
        return (wrap_model(model, options.parallel, device) if group.distributed else model), reference, group.world_size, None
    if options.parallel != "ddp":
        raise TrainingError(f"option --parallel {options.parallel}: on megatron-core's layout (--tp, --ep, --dp-engine megatron) "
                            "the data-parallel replicas run under DDP")
    import harts.parallel
    from torch.nn.parallel import DistributedDataParallel

    layout = harts.parallel.initialize(tensor_parallel=options.tp, expert_parallel=options.ep)
    parallel = harts.parallel.TensorParallelHybridModel.from_model(model, token_dispatcher=options.moe_dispatcher)
    if reference is not None:
        reference = harts.parallel.TensorParallelHybridModel.from_model(
            reference, token_dispatcher=options.moe_dispatcher).requires_grad_(False)
    wrapped = parallel
    if engine == "megatron":  # even at DP = 1: finalize_model_grads also sums the replicated gradients over TP
        from harts.parallel.optim import wrap_megatron

        wrapped = wrap_megatron(parallel)
    elif layout.data_parallel_size > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(parallel, device_ids=device_ids, process_group=layout.data_parallel_group)
    return wrapped, reference, layout.data_parallel_size, layout.data_parallel_group


def _describe(model, options: RunOptions) -> str:
    source = options.hf or options.preset
    return f"{source} ({sum(p.numel() for p in model.parameters()):,} parameters, {model.config.dtype})"


def run_training(options: RunOptions, *, console=None, progress: bool = True) -> TrainingRun:
    """Run ``options.steps`` RL steps on the batch ``options.input`` (see the module docstring)."""
    from harts.compiler import compile as compile_batch
    from harts.rollouts.inputs import resolve_input

    if options.task is not None:
        raise TrainingError(f"task {options.task!r}: online tasks run through harts.train.online.run_online")
    if options.input is None:
        raise TrainingError("no rollout batch: give INPUT (a node table or a preset), 'input' in the config, or --task NAME")
    if options.parallel not in ("ddp", "fsdp"):
        raise TrainingError(f"option --parallel must be 'ddp' or 'fsdp', got {options.parallel!r}")
    check_run_outputs(options)
    group, device, created = init_from_environment()
    metrics_file = None
    previous_precision = torch.get_float32_matmul_precision()
    # The log-prob head forms its [rows, vocab] logits in fp32 (exact normalisers); at "highest" those
    # GEMMs take about half of a bf16 training pass on an H200. TF32 is what bf16 stacks run, and
    # what `harts-bench` times, so the loop a user runs matches the benchmark's pass.
    torch.set_float32_matmul_precision(options.matmul_precision or ("high" if device.type == "cuda" else "highest"))
    try:
        batch = resolve_input(options.input)
        advantages = training_advantages(batch)
        model = build_model(options, batch, device)
        description = _describe(model, options)
        reference = None
        if options.train.kl_coef:
            reference = copy.deepcopy(model).requires_grad_(False)
        wrapped, reference, dp_size, dp_group = _parallel_model(model, reference, options, group, device)
        plan = compile_batch(batch, capacity=options.capacity, dp_size=options.dp or dp_size, chunk_size=options.chunk_size,
                             progress=progress and group.rank == 0)
        optimizer = make_optimizer(wrapped, options)
        trainer = Trainer(wrapped, optimizer, options.train, reference_model=reference, process_group=dp_group)
        if options.metrics is not None and group.rank == 0:
            metrics_file = MetricsFile(options.metrics, option="--metrics")
        records: list[dict[str, Any]] = []
        logger.info("training %s on %s: %d step(s) of %d epoch(s), mode %s, %d rank(s)", description, options.input,
                    options.steps, options.train.epochs, options.train.mode, group.world_size)
        with step_progress(progress and group.rank == 0, console) as update:
            for step in range(options.steps):
                title = f"step {step + 1}/{options.steps}"
                note = f"loss {records[-1]['loss']:.5g}" if records else ""
                result = trainer.step(
                    batch, plan, advantages=advantages,
                    on_microbatch=lambda phase, done, total: update(title, phase, done, total, note),
                )
                records.extend(result.metrics)
                update(title, "done", 1, 1, f"loss {result.metrics[-1]['loss']:.5g}")
                if metrics_file is not None:
                    for record in result.metrics:
                        metrics_file.write(record)
        if options.plot is not None and group.rank == 0:
            from harts.train.plot import plot_metrics

            plot_metrics(records, options.plot, title=f"harts train {options.input}: {description}, {options.train.mode}",
                         option="--plot")
        if options.save is not None:
            save_weights(wrapped, options.save, rank=group.rank, option="--save")
        return TrainingRun(tuple(records), dict(plan.stats), description, group.world_size, group.rank)
    finally:
        torch.set_float32_matmul_precision(previous_precision)
        if metrics_file is not None:
            metrics_file.close()
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()

