"""megatron-core's DDP, finalize_model_grads and distributed optimizer under the trainer (harts.parallel.optim): what runs on the CPU.

megatron-core allocates their buffers and norm tensors on CUDA (harts.parallel.optim's docstring lists
the calls), so their numerics are checked on a GPU (tests/parallel/test_megatron_ddp_gpu.py). Here:
the ``--dp-engine`` option (flags, YAML, defaults) and its refusal off CUDA, the mapping of HARTS'
optimizer options onto megatron's ``OptimizerConfig`` / ``DistributedDataParallelConfig``, the
tensor-parallel replicas marked for ``finalize_model_grads`` against HARTS' own sum at TP = 2 (gloo),
and what the trainer and the checkpoint writer do with a megatron-wrapped model.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from harts.cli import USER_ERROR_EXIT, app
from harts.train import TrainConfig, Trainer, TrainingError
from harts.train.distributed import DP_ENGINES, dp_engine, refuse_megatron_off_cuda, wrapper_kind
from harts.train.loop import RunOptions, load_options
from tests.helpers import REPO, forked_batch
from tests.parallel.test_tensor_parallel import torchrun

pytest.importorskip("megatron.core")

from megatron.core.distributed import DistributedDataParallel  # noqa: E402

from harts.parallel.optim import (  # noqa: E402
    MegatronDataParallelOptions,
    ddp_config,
    optimizer_config,
)


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------- the option


@pytest.mark.parametrize(("tp", "ep", "device", "want"), [
    (2, 1, "cuda", "megatron"), (1, 2, "cuda", "megatron"), (2, 2, "cuda:1", "megatron"),
    (1, 1, "cuda", "torch"), (2, 1, "cpu", "torch"), (1, 2, "cpu", "torch"),
])
def test_the_default_engine_is_megatron_for_a_megatron_layout_on_cuda(tp, ep, device, want):
    assert dp_engine(None, tp=tp, ep=ep, device=torch.device(device)) == want


@pytest.mark.parametrize("engine", DP_ENGINES)
def test_a_chosen_engine_is_kept_where_it_can_run(engine):
    assert dp_engine(engine, tp=1, ep=1, device=torch.device("cuda")) == engine
    if engine == "torch":
        assert dp_engine(engine, tp=2, ep=1, device=torch.device("cpu")) == "torch"


def test_megatron_on_the_cpu_is_refused_naming_the_option_and_the_way_out():
    with pytest.raises(TrainingError) as caught:
        dp_engine("megatron", tp=2, ep=1, device=torch.device("cpu"))
    message = str(caught.value)
    for fragment in ("option --dp-engine megatron", "CUDA only", "torch.cuda.current_device()", "on cpu", "--dp-engine torch"):
        assert fragment in message, message
    with pytest.raises(TrainingError, match="harts.parallel.optim.wrap_megatron: megatron-core's"):
        refuse_megatron_off_cuda(torch.device("cpu"), "harts.parallel.optim.wrap_megatron")


def test_the_option_is_read_from_flags_and_yaml_and_checked(tmp_path):
    assert RunOptions().dp_engine is None
    assert load_options({"dp_engine": "torch"}).dp_engine == "torch"
    config = tmp_path / "run.yaml"
    config.write_text("dp-engine: megatron\ntp: 2\n")
    assert load_options({}, config).dp_engine == "megatron"
    assert load_options({"dp_engine": "torch"}, config).dp_engine == "torch"  # flags win
    with pytest.raises(TrainingError, match="option --dp-engine must be one of torch, megatron, got 'deepspeed'"):
        load_options({"dp_engine": "deepspeed"})
    config.write_text("dp_engine: 1\n")
    with pytest.raises(TrainingError, match=f"config {config}: option 'dp_engine' must be a string"):
        load_options({}, config)
    with pytest.raises(TrainingError, match="option --task and option --dp-engine do not go together"):
        load_options({"task": "count", "dp_engine": "torch"})
    with pytest.raises(TrainingError, match="RunOptions.dp_engine must be one of torch, megatron"):
        RunOptions(dp_engine="Megatron")


def test_harts_train_refuses_megatron_on_the_cpu_with_exit_2(tmp_path):
    table = tmp_path / "rollouts.jsonl"
    forked_batch().write(table)
    result = CliRunner().invoke(app, ["train", str(table), "--dp-engine", "megatron", "--steps", "1",
                                      "--metrics", str(tmp_path / "m.jsonl")])
    assert result.exit_code == USER_ERROR_EXIT, result.output
    assert "option --dp-engine megatron" in one_line(result.output) and "CUDA only" in one_line(result.output)
    assert not (tmp_path / "m.jsonl").exists()


# ---------------------------------------------------------------- the configs


def test_harts_optimizer_options_map_onto_megatron_optimizer_config():
    config = optimizer_config(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, max_grad_norm=0.7,
                              params_dtype=torch.bfloat16)
    assert (config.optimizer, config.lr, config.min_lr) == ("adam", 3e-4, 3e-4)  # constant lr unless a scheduler moves it
    assert (config.adam_beta1, config.adam_beta2, config.adam_eps, config.weight_decay) == (0.9, 0.95, 1e-6, 0.1)
    assert config.decoupled_weight_decay  # AdamW, as the torch path
    assert config.clip_grad == 0.7
    assert config.bf16 and not config.fp16 and config.params_dtype == torch.bfloat16
    assert config.main_params_dtype == torch.float32 and config.main_grads_dtype == torch.float32  # fp32 master weights
    assert config.use_distributed_optimizer
    fp32 = optimizer_config(lr=1e-4, max_grad_norm=None, distributed=False)
    assert fp32.clip_grad == 0.0 and not fp32.bf16 and not fp32.use_distributed_optimizer  # 0: megatron does not clip
    assert (fp32.adam_beta1, fp32.adam_beta2, fp32.adam_eps, fp32.weight_decay) == (0.9, 0.999, 1e-8, 0.0)  # torch AdamW's
    with pytest.raises(TrainingError, match="float16 parameters with loss scaling"):
        optimizer_config(lr=1e-4, params_dtype=torch.float16)
    with pytest.raises(TrainingError, match="Adam betas"):
        optimizer_config(lr=1e-4, betas=(0.9, 1.0))


def test_megatron_ddp_reduces_in_fp32_without_overlap_by_default():
    config = ddp_config()
    assert config.grad_reduce_in_fp32 and config.use_distributed_optimizer
    assert not config.overlap_grad_reduce and not config.overlap_param_gather
    assert not config.average_in_collective  # 1/DP pre-scaled sum: gloo has no AVG, and the trainer scales by DP
    assert config.bucket_size is None  # without overlap megatron makes each buffer one bucket
    overlapped = ddp_config(MegatronDataParallelOptions(overlap_grad_reduce=True, bucket_size=1 << 20,
                                                        distributed_optimizer=False))
    assert overlapped.overlap_grad_reduce and overlapped.bucket_size == 1 << 20 and not overlapped.use_distributed_optimizer
    with pytest.raises(TypeError):
        MegatronDataParallelOptions(bucket_size=1.5)


# ---------------------------------------------------------------- replicas, the trainer, checkpoints


def test_finalize_model_grads_sums_over_tp_what_harts_sums_and_nothing_else(tmp_path):
    """TP = 2 over gloo: the marked parameters are HARTS' replicated ones, and megatron-core's TP sum
    over them gives HARTS' gradients, which gather to the single-process model's."""
    torchrun(2, str(REPO / "tests" / "parallel" / "mdp_worker.py"), "replicas", "2", str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    for variant, found in report.items():
        assert found["marked"] == found["replicated"] and found["marked"], variant
        assert any("norm" in name for name in found["marked"]) and not any("lm_head" in n or "embed" in n for n in found["marked"])
        assert found["sequence_parallel"] and found["tensor_model_parallel_size"] == 2
        assert found["megatron_vs_harts"] < 1e-12, (variant, found["megatron_vs_harts"])
        assert found["megatron_vs_single_process"] < 1e-10, (variant, found["megatron_vs_single_process"])


def unconstructed_megatron_wrapper(module: torch.nn.Module) -> DistributedDataParallel:
    """A megatron ``DistributedDataParallel`` holding ``module``, its __init__ skipped: that allocates the
    gradient buffers on CUDA. What is tested below reads only its class and its ``module``."""
    wrapper = DistributedDataParallel.__new__(DistributedDataParallel)
    torch.nn.Module.__init__(wrapper)
    wrapper.module = module
    return wrapper


def test_the_trainer_refuses_a_megatron_model_with_a_torch_optimizer_and_the_reverse():
    from harts.runtime import HybridConfig, HybridModel
    from harts.runtime.api import unwrap_model

    model = HybridModel(HybridConfig.preset("tiny", vocab_size=64))
    wrapper = unconstructed_megatron_wrapper(model)
    assert wrapper_kind(wrapper) == "megatron" and unwrap_model(wrapper) is model
    with pytest.raises(TrainingError, match="needs megatron-core's optimizer .*got AdamW"):
        Trainer(wrapper, torch.optim.AdamW(model.parameters()), TrainConfig())
    from megatron.core.optimizer import FP32Optimizer

    megatron = FP32Optimizer.__new__(FP32Optimizer)  # type only: its __init__ needs CUDA buffers too
    with pytest.raises(TrainingError, match="megatron-core optimizer needs the model in megatron-core's DistributedDataParallel"):
        Trainer(model, megatron, TrainConfig())


def test_weights_are_saved_from_the_model_inside_megatron_ddp(tmp_path):
    from safetensors.torch import load_file

    from harts.runtime import HybridConfig, HybridModel
    from harts.train.loop import save_weights

    model = HybridModel(HybridConfig.preset("tiny", vocab_size=64))
    save_weights(unconstructed_megatron_wrapper(model), tmp_path / "wrapped.safetensors")
    save_weights(model, tmp_path / "plain.safetensors")
    wrapped, plain = load_file(tmp_path / "wrapped.safetensors"), load_file(tmp_path / "plain.safetensors")
    assert set(wrapped) == set(plain) == set(model.state_dict())  # the HybridModel / HF names, no "module." prefix
    assert all(torch.equal(wrapped[name], plain[name]) for name in plain)
