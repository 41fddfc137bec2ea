"""Helpers shared by the tests (one module to import them from: ``from tests.helpers import ...``).

The Hugging Face helpers need transformers and live in :mod:`tests.helpers.hf`; import them from there.
"""

from tests.helpers.strategies import chunk_aligned_token_trees, forked_trajectories, rollout_batches, token_trees  # noqa: F401
from tests.helpers.frameworks import GARBAGE, agent_episodes, areal_packed, areal_padded, areal_rows, fixed_episodes, trl_batch, verl_batch  # noqa: F401
from tests.helpers.planner import checked_objective, compressed_index, forests, labelled_forests, objective_by_labels, prepared_case, two_groups, work_of  # noqa: F401
from tests.helpers.io import assert_identical, corrupt, node, small_batch, trajectory  # noqa: F401
from tests.helpers.runtime import SMALL_MODEL, forked_batch, make_plan, max_relative_difference, rl_batch, tiny_model  # noqa: F401
from tests.helpers.rounds import all_choices, ancestors, brute_force_critical_path, brute_force_rounds_exhaustive, chunk_steps_of, contract_schedule, brute_force_rounds_fixpoint, chains_for_choice, compressed_module, earliest_rounds, forked_trees, microbatch_split, schedule_is_legal, scheduled_module, segment_tree_tokens, segment_trees, sequence_states, state_key, tree_children  # noqa: F401
from tests.helpers.layout import batches_with_groups, figure_batch, nested_forks_batch, rounded_module  # noqa: F401
from tests.helpers.benchmarks import REPO, load_benchmark  # noqa: F401
