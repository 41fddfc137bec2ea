"""Full-attention head-to-head (issue #8): gathered ancestor KV + varlen FlashAttention vs a
FlexAttention tree mask over one shared KV buffer, per microbatch layout of the plan that
``harts bench`` builds. The code lives in :mod:`harts_bench.attention`; this script is
``harts bench --attention-bench``. Run ``python benchmarks/bench_attention.py --help`` for the options."""

import sys

from harts_bench.runtime import main

if __name__ == "__main__":
    main(["--attention-bench", *sys.argv[1:]])
