"""Shared helpers for the segment and min-call tests (holds no tests itself).

* ``forked_trees``: rollout trees built from explicit segment lengths, so forks land exactly
  at B-1, B, B+1, 2B-1, ... and several forks can sit inside one chunk; some trajectories
  end inside another's path, some are duplicated, several trees may share a microbatch.
* ``scheduled_module``: lower + prefix-compress, then hand-made microbatches at phase
  ``scheduled`` (the real microbatch planner is tested elsewhere).
* a brute-force model of the execution: which boundary states a sequence computes, and
  whether a schedule lets every sequence start from a state that is ready.
"""

from __future__ import annotations




# ---------------------------------------------------------------- brute-force execution model


