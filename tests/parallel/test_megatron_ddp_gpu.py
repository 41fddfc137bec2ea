"""megatron-core's DDP + distributed optimizer under the trainer equal torch DDP + torch AdamW (CUDA, float32).

    python -m pytest tests/parallel/test_megatron_ddp_gpu.py -q

tests/parallel/mdp_worker.py (``compare``) runs, at DP = 2, TP = 2 and TP = 2 x DP = 2, two
``Trainer.step`` calls (2 epochs each: 4 optimizer steps, gradient clipping active, weight decay,
betas (0.9, 0.95)) of a dense KDA + MLA model, once through torch DDP over megatron's data-parallel
group with torch AdamW and once through megatron-core's DDP (fp32 gradient buffers, one
reduce-scatter per step, ``finalize_model_grads``' TP sum of the replicated gradients) with its
distributed optimizer, and checks that losses, gradient norms, old log-probs and weights agree to
float32 round-off; a checkpoint written from the megatron-wrapped model loads into a single-process
``HybridModel`` with the same log-probs.

One GPU per rank, NCCL: megatron-core's reductions run inside ``torch.distributed._coalescing_manager``,
and gloo's coalesced all-reduce takes CPU tensors only ("ProcessGroupGloo::allreduce_coalesced:
unsupported device type"), so the gloo-on-one-GPU layout of test_tensor_parallel_gpu.py cannot carry
them; NCCL refuses two ranks on one GPU. With fewer GPUs than ranks a case is skipped
(``HARTS_MDP_BACKEND=gloo`` tries gloo with every rank on cuda:0 instead). The one-rank case (NCCL, one
GPU) runs megatron's gradient buffers, ``finalize_model_grads``, the distributed optimizer and the
checkpoint path on any GPU machine; its reductions are over groups of one.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import REPO
from tests.parallel.test_tensor_parallel_gpu import torchrun

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: float32 round-off, relative to scale (tp_worker.largest): the two paths reduce in other orders
#: (reduce-scatter of fp32 buffers vs all-reduce, megatron's fused l2-norm vs HARTS' per-tensor sum);
#: Adam's normalised update keeps a weight's difference near lr x the gradients' relative round-off.
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[(1, 1), (1, 2), (2, 2), (2, 4)], ids=["one-rank", "dp2", "tp2", "tp2xdp2"])
def report(request, tmp_path_factory):
    tensor_parallel, processes = request.param
    if torch.cuda.device_count() < processes and os.environ.get("HARTS_MDP_BACKEND") != "gloo":
        pytest.skip(f"needs {processes} GPUs (NCCL, one rank each; gloo cannot run megatron's coalesced reductions "
                    f"on CUDA tensors); this machine has {torch.cuda.device_count()}")
    folder = tmp_path_factory.mktemp(f"mdp-tp{tensor_parallel}-{processes}")
    torchrun(processes, str(REPO / "tests" / "parallel" / "mdp_worker.py"), "compare", str(tensor_parallel), str(folder),
             timeout=600)
    found = json.loads((folder / "report.json").read_text())
    assert found["tp"] * found["dp"] == processes and found["tp"] == tensor_parallel
    return found


@pytest.mark.parametrize("step", [1, 2])
def test_megatron_ddp_and_distributed_optimizer_step_as_torch_ddp_and_adamw(report, step):
    found = report[f"kda-mla/step{step}"]
    assert found["same_microbatches"]
    assert found["clipped"]  # the clipping path runs (the norm exceeds max_grad_norm)
    assert found["moved"] > 1e-4  # the weights moved: an equality of two idle runs proves nothing
    for key in ("loss", "policy_loss", "entropy", "grad_norm", "old_log_probs", "weights"):
        assert found[key] < TOLERANCE, (key, found[key])


def test_log_probs_after_training_and_the_checkpoint_agree(report):
    assert report["kda-mla/log_probs"] < TOLERANCE  # through megatron DDP's forward
    # the checkpoint in a single-process HybridModel against the TP shards: another split of the reductions,
    # bounded as tests/parallel/test_tensor_parallel_gpu.py bounds TP = 2 against one process
    assert report["kda-mla/checkpoint_log_probs"] < 5e-4
