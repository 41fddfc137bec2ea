"""HARTS' benchmarks, ablations, demo job and workload generators (outside the library package).

* :mod:`harts_bench.runtime`: the headline runtime benchmark behind ``harts bench``;
* :mod:`harts_bench.attention`: the full-attention head-to-head (``harts bench --attention-bench``);
* :mod:`harts_bench.ablation`: the node-at-a-time and no-replay execution views;
* :mod:`harts_bench.demo`: the main job behind ``harts run`` / ``make demo``;
* :mod:`harts_bench.workloads`: synthetic rollout steps, registered as ``harts.inputs`` presets.
"""
