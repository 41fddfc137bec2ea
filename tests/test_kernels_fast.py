"""The fast kernels held to the pure-torch references of ``harts.kernels.naive``.

* Triton state scan / fast chunkwise gated delta rule: on CPU under the Triton interpreter,
  in ONE subprocess (``TRITON_INTERPRET=1`` must be set before triton is imported, and
  must not leak into this pytest process); skipped when triton is not installed. The
  cases run small varlen batches with odd lengths, initial states, exported states that a
  second call consumes, KDA and Gated DeltaNet gates, strong decays, bf16 inputs.
* Dispatch, the per-sequence attention path and the grouped MoE path run in-process on CPU.
* ``@pytest.mark.gpu`` tests repeat the comparisons on CUDA (fp32 and bf16), skipped when
  there is no GPU or no triton.
* A smoke test runs ``harts bench`` at toy size on CPU with the naive kernels.

Run the interpreter cases by hand with ``TRITON_INTERPRET=1 python tests/test_kernels_fast.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harts.kernels import attention_fast, dispatch, naive  # noqa: E402
from harts.kernels.moe_fast import moe_experts, patch_experts  # noqa: E402

HAS_TRITON = dispatch.TRITON_AVAILABLE
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- shared cases


def make_inputs(lengths, heads, key_dim, value_dim, *, per_channel, decay_scale=0.5, seed=0, device="cpu",
                dtype=torch.float32, with_initial=True):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    q = torch.nn.functional.normalize(rand(total, heads, key_dim), dim=-1)
    k = torch.nn.functional.normalize(rand(total, heads, key_dim), dim=-1)
    v = rand(total, heads, value_dim)
    gate_shape = (total, heads, key_dim) if per_channel else (total, heads)
    log_decay = -torch.rand(*gate_shape, generator=generator) * decay_scale
    beta = torch.rand(total, heads, generator=generator)
    initial = rand(len(lengths), heads, key_dim, value_dim) if with_initial else None
    tensors = [q, k, v, log_decay, beta] + ([initial] if with_initial else [])
    tensors = [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.long, device=device)
    return tensors, cu


def chained_run(module, first, second, chunk_size, exports, consumers, scale, seed=1):
    """Call 1 exports boundary states; call 2 starts from some of them; loss touches every result.

    Returns the results and the gradients w.r.t. every input of both calls (including call 1's
    initial states, which receive gradient through the exported states)."""
    (inputs1, cu1), (inputs2, cu2) = first, second
    o1, f1, e1 = module.chunk_linear_attention(*inputs1[:5], cu1, chunk_size=chunk_size, scale=scale,
                                               initial_state=inputs1[5], export_chunks=exports)
    initial2 = e1.index_select(0, torch.tensor(consumers, device=e1.device))
    o2, f2, _ = module.chunk_linear_attention(*inputs2[:5], cu2, chunk_size=chunk_size, scale=scale,
                                              initial_state=initial2)
    generator = torch.Generator().manual_seed(seed)
    loss = 0
    for out in (o1, f1, e1, o2, f2):
        loss = loss + (out.float() * torch.randn(out.shape, generator=generator).to(out.device)).sum()
    params = inputs1 + inputs2[:5]
    grads = torch.autograd.grad(loss, params)
    return [o1, f1, e1, o2, f2], list(grads)


RESULT_NAMES = ["o1", "final1", "exported1", "o2", "final2"]
GRAD_NAMES = ["q1", "k1", "v1", "gate1", "beta1", "initial1", "q2", "k2", "v2", "gate2", "beta2"]


def chain_errors(fast, reference, per_channel, chunk_size, device="cpu", dtype=torch.float32, sizes=(2, 16, 16)):
    heads, key_dim, value_dim = sizes
    lengths1 = [5, 2 * chunk_size + 1, 2 * chunk_size, 0, 1, chunk_size - 1]
    chunks = [-(-n // chunk_size) for n in lengths1]
    # boundaries before, on and after chunk edges; the last one is the final state when full
    exports = [list(range(1, c + 1)) for c in chunks]
    first = make_inputs(lengths1, heads, key_dim, value_dim, per_channel=per_channel, seed=3, device=device, dtype=dtype)
    lengths2 = [7, chunk_size + 3, 1]
    consumers = [1, 2, 1]  # two consumers share one exported state: their gradients add up at it
    second = make_inputs(lengths2, heads, key_dim, value_dim, per_channel=per_channel, seed=4, device=device,
                         dtype=dtype, with_initial=False)
    scale = key_dim**-0.5
    got, got_grads = chained_run(fast, first, second, chunk_size, exports, consumers, scale)
    ref_first = ([t.detach().double().requires_grad_() for t in first[0]], first[1])
    ref_second = ([t.detach().double().requires_grad_() for t in second[0]], second[1])
    want, want_grads = chained_run(reference, ref_first, ref_second, chunk_size, exports, consumers, scale)
    errors = {name: rel(a, b) for name, a, b in zip(RESULT_NAMES, got, want)}
    errors.update({f"d_{name}": rel(a, b) for name, a, b in zip(GRAD_NAMES, got_grads, want_grads)})
    errors["o_dtype"] = str(got[0].dtype)
    errors["state_dtype"] = str(got[1].dtype)
    return errors


def strong_decay_errors(fast, reference, device="cpu"):
    """KDA with per-step log decays down to -8: factored exp(G_t) * exp(-G_s) would overflow."""
    chunk_size = 24  # sub-chunks of 12: one diagonal and one off-diagonal block per chunk
    (inputs, cu) = make_inputs([50, 3], 2, 16, 8, per_channel=True, decay_scale=8.0, seed=5, device=device,
                               with_initial=False)
    scale = 0.25
    o, f, _ = fast.chunk_linear_attention(*inputs, cu, chunk_size=chunk_size, scale=scale)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ro, rf, _ = reference.chunk_linear_attention(*ref_inputs, cu, chunk_size=chunk_size, scale=scale)
    weight = torch.linspace(-1, 1, o.numel(), dtype=torch.float64, device=device).view_as(o)
    grads = torch.autograd.grad((o.double() * weight).sum() + f.double().sum(), inputs)
    ref_grads = torch.autograd.grad((ro * weight).sum() + rf.sum(), ref_inputs)
    errors = {"o": rel(o, ro), "final": rel(f, rf)}
    errors.update({f"d_{n}": rel(a, b) for n, a, b in zip(["q", "k", "v", "gate", "beta"], grads, ref_grads)})
    errors["finite"] = bool(torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads))
    return errors


def scan_errors(device="cpu"):
    """The state scan alone against a python loop, with V split over two column blocks."""
    from harts.kernels.state_scan import ScanLayout, state_scan

    generator = torch.Generator().manual_seed(7)
    counts = [3, 0, 2]
    heads, chunk_size, key_dim, value_dim = 1, 5, 40, 200  # K pads to 64 -> V blocks of 128: two blocks
    num_chunks = sum(counts)
    base = [0, 3, 3]

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device).requires_grad_()

    w, kend = rand(num_chunks, heads, chunk_size, key_dim), rand(num_chunks, heads, chunk_size, key_dim)
    u0 = rand(num_chunks, heads, chunk_size, value_dim)
    gamma = torch.rand(num_chunks, heads, key_dim, generator=generator).to(device).requires_grad_()
    initial = rand(len(counts), heads, key_dim, value_dim)
    layout = ScanLayout(torch.tensor(base, device=device), torch.tensor(counts, device=device), num_chunks)
    states, u = state_scan(w, u0, kend, gamma, initial, layout)

    ref_states, ref_u = [], [None] * num_chunks
    for i, count in enumerate(counts):
        state = initial[i]
        for c in range(count):
            chunk = base[i] + c
            ref_states.append(state)
            ref_u[chunk] = u0[chunk] - w[chunk] @ state
            state = gamma[chunk][..., None] * state + kend[chunk].transpose(-1, -2) @ ref_u[chunk]
        ref_states.append(state)
    ref_states, ref_u = torch.stack(ref_states), torch.stack(ref_u)
    weights = torch.randn(states.shape, generator=generator).to(device), torch.randn(u.shape, generator=generator).to(device)
    inputs = [w, u0, kend, gamma, initial]
    grads = torch.autograd.grad((states * weights[0]).sum() + (u * weights[1]).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_states * weights[0]).sum() + (ref_u * weights[1]).sum(), inputs)
    errors = {"states": rel(states, ref_states), "u": rel(u, ref_u)}
    errors.update({f"d_{n}": rel(a, b) for n, a, b in zip(["w", "u0", "kend", "gamma", "initial"], grads, ref_grads)})
    return errors


def interpreter_cases() -> dict:
    """Every interpreter comparison; run in a subprocess with TRITON_INTERPRET=1."""
    from harts.kernels import chunk_fast

    torch.manual_seed(0)
    return {
        "scan": scan_errors(),
        "kda": chain_errors(chunk_fast, naive, per_channel=True, chunk_size=32),
        "gdn": chain_errors(chunk_fast, naive, per_channel=False, chunk_size=16),
        "kda_bf16": chain_errors(chunk_fast, naive, per_channel=True, chunk_size=16, dtype=torch.bfloat16),
        "kda_strong_decay": strong_decay_errors(chunk_fast, naive),
    }


# ----------------------------------------------------------------------------- interpreter tests


@pytest.fixture(scope="module")
def interpreter_results():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, f"interpreter run failed:\n{completed.stdout}\n{completed.stderr[-4000:]}"
    return json.loads(completed.stdout.strip().splitlines()[-1])


FP32_BOUND = 1e-5


def _assert_small(errors: dict, bound: float, case: str) -> None:
    numeric = {k: v for k, v in errors.items() if isinstance(v, float)}
    assert numeric, f"{case}: no comparisons ran"
    bad = {k: v for k, v in numeric.items() if not v <= bound}
    assert not bad, f"{case}: relative errors above {bound}: {bad}"


def test_state_scan_matches_loop_with_split_value_blocks(interpreter_results):
    _assert_small(interpreter_results["scan"], FP32_BOUND, "scan")


@pytest.mark.parametrize("case", ["kda", "gdn"])
def test_fast_chunk_matches_naive_through_exported_states(interpreter_results, case):
    errors = interpreter_results[case]
    _assert_small(errors, FP32_BOUND, case)
    assert errors["o_dtype"] == "torch.float32" and errors["state_dtype"] == "torch.float32"


def test_fast_chunk_accepts_bf16_and_returns_fp32_states(interpreter_results):
    errors = interpreter_results["kda_bf16"]
    assert errors["o_dtype"] == "torch.bfloat16" and errors["state_dtype"] == "torch.float32"
    # the reference runs on the same (bf16-rounded) inputs in float64; o is rounded to bf16
    _assert_small(errors, 1e-2, "kda_bf16")


def test_fast_chunk_is_stable_under_strong_per_channel_decay(interpreter_results):
    errors = interpreter_results["kda_strong_decay"]
    assert errors.pop("finite")
    _assert_small(errors, FP32_BOUND, "kda_strong_decay")


# ----------------------------------------------------------------------------- in-process CPU tests


def test_dispatch_selects_reference_on_cpu(monkeypatch):
    (inputs, cu) = make_inputs([3, 9], 2, 8, 8, per_channel=True)
    monkeypatch.delenv("HARTS_KERNELS", raising=False)
    assert dispatch.kernel_mode() == "auto"
    assert not dispatch.uses_fast_linear_attention(inputs[0], inputs[2], 4)
    assert not dispatch.uses_fast_attention(inputs[0])
    got = dispatch.chunk_linear_attention(*inputs[:5], cu, chunk_size=4, scale=0.3, initial_state=inputs[5])
    want = naive.chunk_linear_attention(*inputs[:5], cu, chunk_size=4, scale=0.3, initial_state=inputs[5])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    monkeypatch.setenv("HARTS_KERNELS", "naive")
    assert not dispatch.uses_fast_attention(inputs[0])
    monkeypatch.setenv("HARTS_KERNELS", "fastest")
    with pytest.raises(ValueError, match="HARTS_KERNELS"):
        dispatch.kernel_mode()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_forced_fast_mode_keeps_uncovered_inputs_on_the_reference(monkeypatch):
    monkeypatch.setenv("HARTS_KERNELS", "fast")
    q = torch.zeros(4, 1, 8)
    assert dispatch.uses_fast_linear_attention(q, q, 16)
    assert not dispatch.uses_fast_linear_attention(q.double(), q.double(), 16)  # fp64 stays exact
    assert not dispatch.uses_fast_linear_attention(q, q, 128)  # chunk above the scan's bound
    assert not dispatch.uses_fast_linear_attention(torch.zeros(4, 1, 512), q, 16)


def test_dispatch_has_the_reference_signatures():
    import inspect

    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    for name in ("chunk_linear_attention", "recurrent_linear_attention", "causal_conv1d", "attention"):
        assert parameters(getattr(dispatch, name)) == parameters(getattr(naive, name)), name


def test_chunk_fast_rejects_unsupported_shapes_clearly():
    from harts.kernels import chunk_fast

    (inputs, cu) = make_inputs([3], 1, 8, 8, per_channel=True)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_fast.chunk_linear_attention(*inputs[:5], cu, chunk_size=128, scale=1.0)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_fast.chunk_linear_attention(*inputs[:5], cu, chunk_size=4, scale=1.0, initial_state=inputs[5][:, :, :4])
    with pytest.raises(ValueError, match="export_chunks"):
        chunk_fast.chunk_linear_attention(*inputs[:5], cu, chunk_size=4, scale=1.0, export_chunks=[[2]])
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_fast.chunk_linear_attention(*inputs[:5], torch.tensor([0, 2]), chunk_size=4, scale=1.0)


def attention_case(device="cpu", dtype=torch.float32, causal=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q_lengths, k_lengths = [3, 0, 5, 1, 17], [7, 2, 5, 9, 40]
    heads_q, heads_kv, key_dim, value_dim = 4, 2, 24, 16  # GQA and Dk != Dv (MLA-like)
    cu_q = torch.tensor([0] + torch.tensor(q_lengths).cumsum(0).tolist(), device=device)
    cu_k = torch.tensor([0] + torch.tensor(k_lengths).cumsum(0).tolist(), device=device)
    q = torch.randn(sum(q_lengths), heads_q, key_dim, generator=generator).to(device, dtype).requires_grad_()
    k = torch.randn(sum(k_lengths), heads_kv, key_dim, generator=generator).to(device, dtype).requires_grad_()
    v = torch.randn(sum(k_lengths), heads_kv, value_dim, generator=generator).to(device, dtype).requires_grad_()
    got = attention_fast.attention(q, k, v, cu_q, cu_k, scale=0.2, causal=causal)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = naive.attention(*refs, cu_q, cu_k, scale=0.2, causal=causal)
    weight = torch.randn(got.shape, generator=generator).to(device, torch.float64)
    grads = torch.autograd.grad((got.double() * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * weight).sum(), refs)
    return {"o": rel(got, want), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}, got.dtype


@pytest.mark.parametrize("causal", [True, False])
def test_attention_per_sequence_path_matches_naive(causal):
    errors, dtype = attention_case(causal=causal)
    assert dtype == torch.float32
    _assert_small(errors, 1e-5, "attention")


def test_attention_fast_rejects_short_key_spans():
    q, k = torch.zeros(3, 1, 8), torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="len_k >= len_q"):
        attention_fast.attention(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 2]), scale=1.0)


def moe_case(device="cpu", dtype=torch.float32):
    from harts.runtime import HybridConfig
    from harts.runtime.moe import Experts

    torch.manual_seed(0)
    config = HybridConfig.preset("tiny", num_experts=6, num_experts_per_tok=2)
    experts = Experts(config).to(device)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.5)
        experts.down_proj.normal_(0, 0.5)
    experts = experts.to(dtype)
    rows = 29
    x = torch.randn(rows, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    indices = torch.stack([torch.randperm(5, device=device)[:2] for _ in range(rows)])  # expert 5 never hit
    weights = torch.rand(rows, 2, device=device, dtype=dtype, requires_grad=True)
    want = experts(x, indices, weights)
    got = moe_experts(x, indices, weights, experts.gate_up_proj, experts.down_proj)
    params = (x, weights, experts.gate_up_proj, experts.down_proj)
    grads = torch.autograd.grad(got.float().square().sum(), params)
    ref_grads = torch.autograd.grad(want.float().square().sum(), params)
    return {"y": rel(got, want), **{f"d{i}": rel(a, b) for i, (a, b) in enumerate(zip(grads, ref_grads))}}


def test_grouped_experts_match_reference_loop():
    _assert_small(moe_case(), 1e-6, "moe")


def test_patch_experts_keeps_model_outputs():
    from harts.runtime import BaselineView, HybridConfig, HybridModel

    torch.manual_seed(1)
    model = HybridModel(HybridConfig.preset("tiny", num_layers=2, layer_types=["linear", "full"], ffn="moe",
                                            first_k_dense_replace=0))
    ids = torch.randint(0, model.config.vocab_size, (23,))
    view = BaselineView([10, 13], model.config.chunk_size)
    before, _ = model.forward_hidden(ids, view)
    assert patch_experts(model) == 2
    after, _ = model.forward_hidden(ids, view)
    assert rel(after, before) < 1e-6


def tree_attention_case(device="cpu", dtype=torch.float32, rows=300, seed=0):
    """A random forest of rows (shuffled ids): tree attention vs each row against its gathered ancestor chain."""
    import numpy as np

    from harts.kernels.tree_attention import tree_attention

    rng = np.random.default_rng(seed)
    chain_parent = np.array([-1] + [int(rng.integers(-1, i)) if rng.random() < 0.3 else i - 1 for i in range(1, rows)])
    permutation = rng.permutation(rows)
    inverse = np.argsort(permutation)
    parent = np.where(chain_parent[permutation] >= 0, inverse[np.maximum(chain_parent[permutation], 0)], -1)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 4, 24, generator=generator).to(device, dtype).requires_grad_()
    k = torch.randn(rows, 2, 24, generator=generator).to(device, dtype).requires_grad_()
    v = torch.randn(rows, 2, 16, generator=generator).to(device, dtype).requires_grad_()
    got = tree_attention(q, k, v, parent, scale=0.3)
    chains = []
    for row in range(rows):
        chain, node = [], row
        while node >= 0:
            chain.append(node)
            node = parent[node]
        chains.append(chain[::-1])
    gather = torch.as_tensor(np.concatenate(chains), device=device)
    cu_k = torch.tensor([0] + np.cumsum([len(c) for c in chains]).tolist(), device=device)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = naive.attention(refs[0], refs[1][gather], refs[2][gather], torch.arange(rows + 1, device=device), cu_k,
                           scale=0.3)
    weight = torch.randn(got.shape, generator=generator).to(device, torch.float64)
    grads = torch.autograd.grad((got.double() * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * weight).sum(), refs)
    return {"o": rel(got, want), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}


def test_tree_attention_matches_gathered_ancestor_views():
    _assert_small(tree_attention_case(), 1e-5, "tree attention")


def test_layout_parents_chain_every_trajectory_to_its_root():
    import numpy as np

    import harts
    from harts.kernels.tree_attention import layout_parents, preorder
    from harts.workloads import swe_like_step

    batch = swe_like_step(seed=3, scale=0.004, vocab_size=256)
    plan = harts.compile(batch, capacity=65536, chunk_size=16)
    layout = plan.layout(0)
    parent = layout_parents(layout)
    for member in range(len(layout.trajectories)):
        rows = layout.trajectory_rows[layout.trajectory_offsets[member] : layout.trajectory_offsets[member + 1]]
        assert parent[rows[0]] == -1
        assert np.array_equal(parent[rows[1:]], rows[:-1])
    order, leave = preorder(parent)
    assert sorted(order.tolist()) == list(range(layout.num_rows))
    assert np.all(leave > np.arange(layout.num_rows))


# ----------------------------------------------------------------------------- benchmark smoke test


def test_bench_runtime_smoke_on_cpu(tmp_path):
    """bench_runtime end to end at toy size with the naive kernels (well under 30 s on one core)."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, HARTS_KERNELS="naive", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "harts", "bench", "--device", "cpu", "--preset", "tiny",
         "--layers", "2", "--tokens", "800", "--scale", "0.004", "--warmup", "1", "--repeats", "1",
         "--kernels", "naive", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    headline = [line for line in completed.stdout.splitlines() if line.startswith("headline:")]
    assert len(headline) == 1
    results = json.loads(out.read_text())
    assert results["compression"] > 1.0
    assert results["linear_attention_calls_per_microbatch"]["harts"] >= 1
    assert results["fidelity"]["cosine"] > 0.999999
    assert results["fidelity"]["rerun_cosine"] > 0.999999
    assert results["gradient_cosine"] > 0.999999
    assert results["mean_abs_logprob_delta"] < 1e-5
    for key in ("baseline", "harts", "sequence_at_a_time", "node_at_a_time"):
        assert results[key]["mean_seconds"] > 0
    calls = results["linear_attention_calls_per_microbatch"]
    assert calls["node_at_a_time"] == sum(results["plan"]["trie_nodes_per_microbatch"]) / results["plan"]["microbatches"]
    assert calls["node_at_a_time"] >= calls["sequence_at_a_time"] >= calls["harts"]
    assert results["node_at_a_time_mean_abs_logprob_delta"] < 1e-5
    assert results["node_at_a_time_speedup"] > 0


# ----------------------------------------------------------------------------- GPU


@gpu
@needs_gpu
@pytest.mark.parametrize("per_channel", [True, False], ids=["kda", "gdn"])
def test_gpu_fast_chunk_fp32(per_channel):
    from harts.kernels import chunk_fast

    errors = chain_errors(chunk_fast, naive, per_channel=per_channel, chunk_size=64, device="cuda", sizes=(4, 128, 128))
    _assert_small(errors, 1e-4, "gpu fp32")


@gpu
@needs_gpu
def test_gpu_fast_chunk_bf16():
    from harts.kernels import chunk_fast

    errors = chain_errors(chunk_fast, naive, per_channel=True, chunk_size=64, device="cuda", dtype=torch.bfloat16,
                          sizes=(4, 128, 128))
    assert errors.pop("o_dtype") == "torch.bfloat16"
    _assert_small(errors, 2e-2, "gpu bf16")


@gpu
@needs_gpu
def test_gpu_strong_decay_and_scan():
    from harts.kernels import chunk_fast

    errors = strong_decay_errors(chunk_fast, naive, device="cuda")
    assert errors.pop("finite")
    _assert_small(errors, 1e-4, "gpu strong decay")
    _assert_small(scan_errors(device="cuda"), 1e-4, "gpu scan")


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-flash", "fp32-sdpa"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_attention(dtype, causal):
    errors, out_dtype = attention_case(device="cuda", dtype=dtype, causal=causal)
    assert out_dtype == dtype
    _assert_small(errors, 2e-2 if dtype == torch.bfloat16 else 1e-4, f"gpu attention {dtype}")


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_experts(dtype):
    _assert_small(moe_case(device="cuda", dtype=dtype), 2e-2 if dtype == torch.bfloat16 else 1e-5, "gpu moe")


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tree_attention_flex(dtype):
    _assert_small(tree_attention_case(device="cuda", dtype=dtype, rows=700), 2e-2 if dtype == torch.bfloat16 else 1e-4,
                  "gpu tree attention")


@gpu
@needs_gpu
def test_gpu_model_log_probs_match_reference_kernels():
    """A tiny model on CUDA: HARTS plan with the fast kernels vs the baseline with the reference kernels."""
    import harts
    from harts.runtime import HybridConfig, HybridModel, log_probs, log_probs_baseline
    from harts.workloads import swe_like_step

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = HybridModel(HybridConfig.preset("tiny", num_layers=4, chunk_size=16))
    batch = swe_like_step(seed=2, scale=0.01, vocab_size=model.config.vocab_size)
    plan = harts.compile(batch, capacity=65536, chunk_size=16)
    fast = log_probs(model, plan, batch, recompute=True, kernels=dispatch)
    grads_fast = torch.autograd.grad(fast.packed.sum(), list(model.parameters()), allow_unused=True)
    ref = log_probs_baseline(model, batch, recompute=True, kernels=naive)
    grads_ref = torch.autograd.grad(ref.packed.sum(), list(model.parameters()), allow_unused=True)
    assert rel(fast.packed, ref.packed) < 1e-4
    for a, b in zip(grads_fast, grads_ref):
        if a is not None and b is not None and b.norm() > 0:
            assert rel(a, b) < 1e-3


if __name__ == "__main__":
    # the subprocess side of ``interpreter_results``: print one JSON line of relative errors
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("set TRITON_INTERPRET=1 (the cases run the Triton kernels on the CPU interpreter)")
    print(json.dumps(interpreter_cases()))
