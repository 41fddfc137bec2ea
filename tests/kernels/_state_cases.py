"""Cases for the linear-attention state kernels, run by ``test_linear_attention_state.py`` in a subprocess.

``TRITON_INTERPRET=1`` must be set before triton is imported and must not leak into the test
process, so the kernels run here, in a child, and print one JSON line of relative errors.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def export_maps(counts, offsets, requests):
    chunk_export = torch.full((offsets[-1],), -1, dtype=torch.int32)
    final_export = torch.full((len(counts),), -1, dtype=torch.int32)
    for slot, (sequence, chunks) in enumerate(requests):
        if chunks < counts[sequence]:
            chunk_export[offsets[sequence] + chunks] = slot
        else:
            final_export[sequence] = slot
    return chunk_export, final_export


def run_case(seed: int, lengths: list[int], chunk_size: int, heads: int, key_dim: int, value_dim: int,
             block_v: int | None = None) -> dict:
    from harts.kernels.linear_attention.state import scan_backward, scan_forward, scan_reference

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()
    total = bounds[-1]
    counts = [-(-n // chunk_size) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
    # every boundary of some sequences, the final state of others, one state asked for twice
    requests = []
    for sequence, count in enumerate(counts):
        for chunks in range(1, count + 1):
            if rng.random() < 0.5:
                requests.append((sequence, chunks))
    requests = list(dict.fromkeys(requests))
    chunk_export, final_export = export_maps(counts, offsets, requests)

    f64 = torch.float64
    kg = (torch.randn(total, heads, key_dim, dtype=f64) * 0.3).requires_grad_()
    w = (torch.randn(total, heads, key_dim, dtype=f64) * 0.3).requires_grad_()
    u = torch.randn(total, heads, value_dim, dtype=f64).requires_grad_()
    gk = (-torch.rand(total, heads, key_dim, dtype=f64) * 0.2).requires_grad_()
    h0 = torch.randn(len(lengths), heads, key_dim, value_dim, dtype=f64).requires_grad_()
    cu, co = torch.tensor(bounds), torch.tensor(offsets)

    h, v_new, final, exported = scan_forward(
        kg.detach().float(), w.detach().float(), u.detach().float(), gk.detach().float(), h0.detach().float(),
        cu, co, chunk_export, final_export, len(requests), chunk_size, num_chunks=offsets[-1], block_v=block_v,
    )
    starts, v_ref, final_ref, exported_ref = scan_reference(kg, w, u, gk, h0, bounds, chunk_size, requests)
    errors = {
        "h": relative_error(h, torch.stack(starts)) if starts else 0.0,
        "v_new": relative_error(v_new, v_ref),
        "final": relative_error(final, final_ref),
        "exported": relative_error(exported, exported_ref) if requests else 0.0,
        "exports": len(requests),
    }

    # backward: the kernel's loss is o = scale * qg . h(chunk) against do, v_new against dv, plus
    # the final and exported states against their gradients
    qg = (torch.randn(total, heads, key_dim, dtype=f64) * 0.3).requires_grad_()
    do, dv = torch.randn(total, heads, value_dim, dtype=f64), torch.randn(total, heads, value_dim, dtype=f64)
    d_final = torch.randn_like(final_ref)
    d_exported = torch.randn_like(exported_ref)
    scale = 0.7
    chunk_of_row = [offsets[s] + r // chunk_size for s, n in enumerate(lengths) for r in range(n)]
    for state in starts:
        state.retain_grad()
    o_inter = scale * torch.einsum("thk,thkv->thv", qg, torch.stack(starts)[chunk_of_row])
    loss = (o_inter * do).sum() + (v_ref * dv).sum() + (final_ref * d_final).sum() + (exported_ref * d_exported).sum()
    loss.backward()
    dh, dh0, dv2 = scan_backward(
        qg.detach().float(), kg.detach().float(), w.detach().float(), gk.detach().float(), do.float(), dv.float(),
        d_final.float(), d_exported.float(), True, cu, co, chunk_export, final_export, scale, chunk_size,
        num_chunks=offsets[-1], block_v=block_v,
    )
    # dh[j]: gradient of the state at the end of chunk j (the next chunk's start, or the final state)
    want_dh = []
    for sequence, count in enumerate(counts):
        for chunk in range(count):
            j = offsets[sequence] + chunk
            if chunk + 1 < count:
                want_dh.append(starts[j + 1].grad)
            else:
                extra = sum((d_exported[e] for e, r in enumerate(requests) if r == (sequence, count)),
                            torch.zeros_like(d_final[sequence]))
                want_dh.append(d_final[sequence] + extra)
    errors.update({
        "dh": relative_error(dh, torch.stack(want_dh)) if want_dh else 0.0,
        "dh0": relative_error(dh0, h0.grad),
        "dv2": relative_error(dv2, u.grad),
    })
    return errors


CASES = [
    # lengths around the chunk size (B-1, B, B+1), an empty sequence, a long one
    dict(seed=0, lengths=[15, 16, 17, 0, 40, 1], chunk_size=16, heads=2, key_dim=16, value_dim=8),
    # head dims that are not powers of two and a value dim split over several program blocks
    dict(seed=1, lengths=[33, 7, 64], chunk_size=32, heads=1, key_dim=24, value_dim=40),
    # the narrowest value-column block a scan with few sequences takes, whole and partial
    dict(seed=0, lengths=[15, 16, 17, 0, 40, 1], chunk_size=16, heads=2, key_dim=16, value_dim=8, block_v=16),
    dict(seed=1, lengths=[33, 7, 64], chunk_size=32, heads=1, key_dim=24, value_dim=40, block_v=16),
]


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("set TRITON_INTERPRET=1: the cases run the Triton kernels on the CPU interpreter")
    print(json.dumps([run_case(**case) for case in CASES]))
