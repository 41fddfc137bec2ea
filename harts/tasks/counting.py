"""``count``: count modulo M in steps of k, over two turns with an observation between them.

Vocabulary (M + 8 tokens, 16 at the default M = 8): ``BOS``, ``SEP`` (the policy's turn
starts), ``OBS`` (an observation starts), the digits 0..M-1 and five instruction tokens. A
prompt is::

    BOS  I1 I2 I3 I4 I5  k  s  SEP                     (k in 1..3, s a digit)

The policy then writes ``turn_length`` digits; each is right when it is its predecessor
plus k modulo M (the first one's predecessor is s). The environment answers with::

    OBS  c  s'  SEP                                    (c = digits right in turn 1, s' a fresh start)

and the policy counts again from s'. The reward is the fraction of right digits over both
turns, so it is dense (every digit counts on its own), and reaching it needs the step k read
from the prompt, a dozen tokens back, through the hybrid model's linear and full attention.
At the defaults a uniform policy scores 1/16 and the best policy that ignores k about 1/3.
Options (``count:prompts=4,turn_length=3,modulus=10``): prompts per step, digits per turn, M.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harts.errors import HartsError
from harts.tasks.base import Episode, Task
from harts.tasks.trees import TreeShape

__all__ = ["CountingTask"]

BOS, SEP, OBS = 0, 1, 2
FIRST_DIGIT = 3


#: Bounds of the task's options. The vocabulary is modulus + 8 tokens (a modulus of 2e9 asked for a 256 GB
#: embedding); every prompt samples turn_length tokens per turn on each branch of its tree, one decode step
#: each (turn_length 100000 ran past 300 s for one RL step); prompts multiply both.
OPTION_RANGES = {"prompts": (1, 1024), "turn_length": (1, 64), "modulus": (2, 1024)}


class CountingTask(Task):
    name = "count"
    summary = "count mod 8 in steps of k (1-3) over two turns; reward: fraction of right digits"

    OPTIONS = {"prompts": int, "turn_length": int, "modulus": int}

    def __init__(self, *, prompts: int = 16, turn_length: int = 4, modulus: int = 8, steps: Sequence[int] | None = None,
                 shape: TreeShape | None = None):
        for name, value, (least, most) in (("prompts", prompts, OPTION_RANGES["prompts"]),
                                           ("turn_length", turn_length, OPTION_RANGES["turn_length"]),
                                           ("modulus", modulus, OPTION_RANGES["modulus"])):
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise HartsError(f"task 'count': option {name} must be an int in [{least}, {most}], got {value!r}")
        if steps is None:
            steps = tuple(k for k in (1, 2, 3) if k < modulus)
        if not steps or any(not 1 <= int(k) < modulus for k in steps):
            raise HartsError(f"task 'count': steps must lie in [1, modulus), got {steps!r}")
        self.modulus = modulus
        self.steps = tuple(int(k) for k in steps)
        self.turn_length = turn_length
        self.shape = shape or TreeShape(branches=(4, 2), inner_forks=(1, 0))
        self.prompts_per_step = prompts
        self.instruction = tuple(range(FIRST_DIGIT + self.modulus, FIRST_DIGIT + self.modulus + 5))
        self.vocab_size = FIRST_DIGIT + self.modulus + len(self.instruction)
        # A small hybrid policy: KDA, MLA, MoE (the "tiny" preset, shrunk).
        self.model = dict(
            vocab_size=self.vocab_size, hidden_size=32, num_layers=3, layer_types=("linear", "full", "linear"),
            intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            num_attention_heads=2, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        )
        # One update per batch (verl's default ppo_epochs) and Adam eps 1e-4: see "Sensitivity" in harts.train.online.
        # Plans with chunk 4 put forks before, on and after chunk boundaries.
        self.defaults = dict(steps=100, lr=2e-3, epochs=1, adam_eps=1e-4, dtype="float64", chunk_size=4)

    def digit(self, value: int) -> int:
        return FIRST_DIGIT + value % self.modulus

    def episode(self, rng: np.random.Generator) -> Episode:
        step = int(rng.choice(self.steps))
        starts = tuple(int(s) for s in rng.integers(0, self.modulus, size=self.turns))
        prompt = (BOS, *self.instruction, self.digit(step), self.digit(starts[0]), SEP)
        return Episode(prompt=prompt, data={"step": step, "starts": starts})

    def right(self, episode: Episode, turns: Sequence[Sequence[int]]) -> list[int]:
        """Right digits of each turn."""
        step, starts = episode.data["step"], episode.data["starts"]
        counts = []
        for index, turn in enumerate(turns):
            previous, right = self.digit(starts[index]), 0
            for token in turn:
                right += int(previous != -1 and int(token) == self.digit(previous - FIRST_DIGIT + step))
                previous = int(token) if FIRST_DIGIT <= int(token) < FIRST_DIGIT + self.modulus else -1
            counts.append(right)
        return counts

    def observation(self, episode: Episode, turns: Sequence[Sequence[int]]) -> Sequence[int]:
        right = self.right(episode, turns)[-1]
        return (OBS, self.digit(right), self.digit(episode.data["starts"][len(turns)]), SEP)

    def reward(self, episode: Episode, turns: Sequence[Sequence[int]]) -> float:
        return sum(self.right(episode, turns)) / (self.turn_length * len(turns))
