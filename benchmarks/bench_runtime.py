"""Headline runtime benchmark (paper §5.3-5.4); the code lives in :mod:`harts_bench.runtime` so that
``harts bench`` runs it too. Run ``python benchmarks/bench_runtime.py --help`` for the options."""

from harts_bench.runtime import main

if __name__ == "__main__":
    main()
