"""Value-column block of HARTS' linear-attention state scans on a plan's real rounds (GPU).

For each round of the headline plan (the bench's SWE-like workload near a target compression),
times the forward and reverse state scans of :mod:`harts.kernels.linear_attention.state` at
value-column blocks 64, 32 and 16 (and each ``--launch`` of warps and pipeline stages) on random bf16 inputs of the model's shape, checks that every
block gives bit-identical results, and prints the block ``_launch_shape`` picks. The numbers
behind the block rule in ``_launch_shape`` (benchmarks/RESULTS.md, sixth session).

    python benchmarks/bench_state_blocks.py --tokens 200000 --scale 0.25 --target-compression 5.6
    python benchmarks/bench_state_blocks.py --launch 4,2 --launch 8,2 --launch 2,2 --launch 4,3
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import harts
from harts.codegen.fx import round_schedule
from harts.kernels.linear_attention import state
from harts.rollouts.workloads import swe_like_step, trees_near_compression


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--target-compression", type=float, default=5.6)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=157184)
    parser.add_argument("--launch", dest="launches", action="append", default=None, metavar="WARPS,STAGES",
                        help="a (num_warps, num_stages) launch to time beside each block (repeatable; default 4,2)")
    args = parser.parse_args(argv)
    args.launches = [tuple(int(n) for n in launch.split(",")) for launch in (args.launches or ["4,2"])]
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark times Triton kernels: it needs a CUDA GPU")
    import triton

    batch = trees_near_compression(swe_like_step(seed=1, scale=args.scale, vocab_size=args.vocab_size),
                                   args.tokens, args.target_compression, args.capacity)
    layout = harts.compile(batch, capacity=args.capacity, chunk_size=args.chunk_size).layout(0)
    heads, dim, chunk = args.heads, args.head_dim, args.chunk_size
    device = torch.device("cuda")
    torch.manual_seed(0)
    for r in range(layout.num_rounds):
        bounds = round_schedule(layout, r)["cu_seqlens"]
        lengths = np.diff(bounds)
        offsets = np.concatenate([[0], np.cumsum(-(-lengths // chunk))])
        total, num_chunks = int(bounds[-1]), int(offsets[-1])
        cu = torch.tensor(bounds, device=device)
        co = torch.tensor(offsets, device=device)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, device=device) * scale).bfloat16()

        kg, w, qg = rand(total, heads, dim, scale=0.1), rand(total, heads, dim, scale=0.1), rand(total, heads, dim, scale=0.1)
        u, do, dv = rand(total, heads, dim), rand(total, heads, dim), rand(total, heads, dim)
        gk = -torch.rand(total, heads, dim, device=device) * 0.05
        h0 = torch.randn(len(lengths), heads, dim, dim, device=device) * 0.1
        d_final = torch.randn(len(lengths), heads, dim, dim, device=device)
        picked = [state._launch_shape(dim, torch.bfloat16, len(lengths) * heads, device, scan=scan)[0]
                  for scan in ("forward", "reverse")]
        line = [f"round {r}: {len(lengths)} sequences, {total} rows, longest {int(np.max(-(-lengths // chunk)))} chunks, "
                f"picked {picked[0]} / {picked[1]}"]
        reference = None
        for block in (64, 32, 16):
            for warps, stages in args.launches:
                def forward():
                    return state.scan_forward(kg, w, u, gk, h0, cu, co, None, None, 0, chunk, num_chunks=num_chunks,
                                              block_v=block, num_warps=warps, num_stages=stages)

                def reverse():
                    return state.scan_backward(qg, kg, w, gk, do, dv, d_final, None, True, cu, co, None, None,
                                               dim**-0.5, chunk, num_chunks=num_chunks, block_v=block,
                                               num_warps=warps, num_stages=stages)

                results = forward() + reverse()
                reference = reference or results
                same = all(torch.equal(a, b) for a, b in zip(results, reference) if a is not None)
                line.append(f"BV={block} warps={warps} stages={stages}: fwd {triton.testing.do_bench(forward):.3f} ms, "
                            f"rev {triton.testing.do_bench(reverse):.3f} ms, bitwise {same}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
