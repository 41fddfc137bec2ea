"""megatron-core MoE layers on one GPU (H200): TP = 2, EP = 2 and TP = 2 x EP = 2 as processes sharing the GPU
over gloo (float32, fast kernels), against one process. gloo has no all_to_all for CUDA tensors, so these runs
use the all-gather token dispatcher (the all-to-all one is tested on CPU, tests/parallel/test_expert_parallel.py).
Run with ``python -m pytest -q -m gpu tests/parallel``."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import REPO
from tests.parallel.test_tensor_parallel_gpu import torchrun

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: float32 round-off relative to scale (tp_worker.largest), as in test_tensor_parallel_gpu.py
TOLERANCE = 5e-4
LAYOUTS = {"tp2": (2, 1, 2), "ep2": (1, 2, 2), "tp2xep2": (2, 2, 4)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layers_on_one_gpu_over_gloo_equal_one_process(tmp_path, name):
    """tests/parallel/ep_worker.py on CUDA: log-probs, router statistics, gradients and one Trainer.step."""
    tensor_parallel, expert_parallel, processes = LAYOUTS[name]
    torchrun(processes, str(REPO / "tests" / "parallel" / "ep_worker.py"), str(tensor_parallel), str(expert_parallel),
             "allgather", str(tmp_path), env={"TP_WORKER_DEVICE": "cuda:0"})
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["tp"], report["ep"]) == (tensor_parallel, expert_parallel)
    assert report["allgather/local_experts"] == [4 // expert_parallel] * 2
    checked = 0
    for key, found in report.items():
        if key.startswith("allgather/") and isinstance(found, dict):
            for field, value in found.items():
                if field not in ("rows", "moved", "checkpoint_log_probs"):
                    assert value < TOLERANCE, (key, field, value)
                    checked += 1
            if key.endswith("/step"):
                assert found["moved"] > 1e-4, key
    assert checked > 40
