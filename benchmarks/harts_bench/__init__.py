"""HARTS' benchmarks and ablations (outside the library package; the library never imports them).

* :mod:`harts_bench.runtime`: the headline runtime benchmark, the ``harts-bench`` console script;
* :mod:`harts_bench.attention`: the full-attention head-to-head (``harts-bench --attention-bench``);
* :mod:`harts_bench.ablation`: the node-at-a-time and no-replay execution views;
* :mod:`harts_bench.profiling`: time by operator family and kernel, device idle gaps, host-sync sites.

The workload generators behind the presets live in the library (:mod:`harts.rollouts.workloads`),
the main job (``harts run``) too (:mod:`harts.train.demo`).
"""
