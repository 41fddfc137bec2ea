"""Agent episodes and the batch dicts verl, TRL and AReaL would hold for them (test helpers).

An episode trajectory is ``(tokens, generated, prompt_length)``: ``generated[t]`` is 1 on tokens
the policy sampled and 0 on prompt and tool-output tokens. ``values[i][t]`` (one array of
``len - 1`` per trajectory) plays the log-prob of ``tokens[t + 1]`` that the framework's own
trajectory-wise forward computes; each builder lays those values out exactly as its framework
does (see the docstrings of :mod:`harts.interop`), padding filled with a garbage value so that
nothing can rely on it.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

GARBAGE = 7.25


@st.composite
def agent_episodes(draw, *, vocab: int = 12, max_trajectories: int = 6):
    """Multi-turn trajectories (assistant turns, tool outputs) forking inside and between turns."""
    trajectories: list[tuple[list[int], list[int], int]] = []
    for _ in range(draw(st.integers(1, max_trajectories))):
        if trajectories and draw(st.booleans()):
            tokens, generated, prompt = draw(st.sampled_from(trajectories))
            cut = draw(st.integers(prompt, len(tokens)))
            tokens, generated = tokens[:cut], generated[:cut]
        else:
            prompt = draw(st.integers(1, 6))
            tokens, generated = draw(st.lists(st.integers(0, vocab - 1), min_size=prompt, max_size=prompt)), [0] * prompt
        for _turn in range(draw(st.integers(1, 3))):
            for role in (1, 0):
                if role == 0 and draw(st.booleans()):
                    continue
                count = draw(st.integers(1, 4))
                tokens = tokens + draw(st.lists(st.integers(0, vocab - 1), min_size=count, max_size=count))
                generated = generated + [role] * count
        trajectories.append((tokens, generated, prompt))
    return trajectories


def fixed_episodes(seed: int = 0, vocab: int = 40) -> list[tuple[list[int], list[int], int]]:
    """Two prompts, four rollouts each, forks inside assistant turns, at turn boundaries and inside tool outputs."""
    rng = np.random.default_rng(seed)

    def draw(n):
        return rng.integers(0, vocab, n).tolist()

    out = []
    for prompt_length in (9, 5):
        prompt = draw(prompt_length)
        trunk = prompt + draw(6) + draw(4) + draw(7)  # assistant 6, tool 4, assistant 7
        roles = [0] * prompt_length + [1] * 6 + [0] * 4 + [1] * 7
        out.append((trunk, roles, prompt_length))
        for cut in (prompt_length + 3, prompt_length + 6, prompt_length + 8):  # in a turn, on a boundary, in a tool output
            tokens = trunk[:cut] + draw(5)
            out.append((tokens, roles[:cut] + [1] * 5, prompt_length))
    return out


def _responses(episodes):
    return [len(tokens) - prompt for tokens, _, prompt in episodes]


def verl_batch(episodes, values, *, extra_width: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """verl's ``DataProto.batch``: left-padded prompts, right-padded responses, [B, R] label-aligned fields."""
    rng = np.random.default_rng(seed)
    count = len(episodes)
    prompt_width = max(prompt for _, _, prompt in episodes) + 1
    width = max(_responses(episodes)) + extra_width
    input_ids = np.zeros((count, prompt_width + width), np.int64)
    attention = np.zeros_like(input_ids)
    response_mask = np.zeros((count, width), np.int64)
    old = np.full((count, width), GARBAGE, np.float32)
    advantages = rng.normal(size=(count, width)).astype(np.float32)
    for b, ((tokens, generated, prompt), lp) in enumerate(zip(episodes, values)):
        response = len(tokens) - prompt
        columns = np.arange(prompt_width - prompt, prompt_width + response)
        input_ids[b, columns] = tokens
        attention[b, columns] = 1
        response_mask[b, :response] = generated[prompt:]
        old[b, :response] = np.asarray(lp)[prompt - 1 :]  # log p(responses[j]) = values[P + j - 1]
    position_ids = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "prompts": input_ids[:, :prompt_width].copy(),
        "responses": input_ids[:, prompt_width:].copy(),
        "response_mask": response_mask,
        "old_log_probs": old,
        "advantages": advantages * response_mask,
        "uid": np.array([f"prompt-{tokens[0]}" for tokens, _, _ in episodes], dtype=object),
    }


def trl_batch(episodes, values, *, extra_width: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """TRL GRPOTrainer's loss inputs: left-padded prompt, right-padded completion, tool_mask, [B] advantages."""
    rng = np.random.default_rng(seed)
    count = len(episodes)
    prompt_width = max(prompt for _, _, prompt in episodes) + 1
    width = max(_responses(episodes)) + extra_width
    prompt_ids = np.zeros((count, prompt_width), np.int64)
    prompt_mask = np.zeros_like(prompt_ids)
    completion_ids = np.zeros((count, width), np.int64)
    completion_mask = np.zeros_like(completion_ids)
    tool_mask = np.ones_like(completion_ids)
    old = np.full((count, width), GARBAGE, np.float64)
    for b, ((tokens, generated, prompt), lp) in enumerate(zip(episodes, values)):
        response = len(tokens) - prompt
        prompt_ids[b, prompt_width - prompt :] = tokens[:prompt]
        prompt_mask[b, prompt_width - prompt :] = 1
        completion_ids[b, :response] = tokens[prompt:]
        completion_mask[b, :response] = 1
        tool_mask[b, :response] = generated[prompt:]
        old[b, :response] = np.asarray(lp)[prompt - 1 :]
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": rng.normal(size=count),
        "old_per_token_logps": old,
        "num_items_in_batch": np.asarray(int(completion_mask.sum())),
    }


def areal_rows(episodes, values) -> list[dict[str, np.ndarray]]:
    """AReaL workflow outputs, one per trajectory: token-aligned ``logprobs`` (0 off the generated tokens)."""
    rows = []
    for (tokens, generated, _), lp in zip(episodes, values):
        logprobs = np.concatenate([[0.0], np.asarray(lp, np.float64)]) * np.asarray(generated)
        rows.append({
            "input_ids": np.asarray(tokens, np.int64),
            "loss_mask": np.asarray(generated, np.int64),
            "logprobs": logprobs.astype(np.float32),
            "versions": np.where(np.asarray(generated) > 0, 3, -1),
            "rewards": np.float32(len(tokens) % 3),
        })
    return rows


def areal_padded(rows) -> dict[str, np.ndarray]:
    """AReaL's concat_padded_tensors: right padding with an attention mask."""
    width = max(len(r["input_ids"]) for r in rows) + 1
    out = {"attention_mask": np.zeros((len(rows), width), np.int64)}
    for key in ("input_ids", "loss_mask", "logprobs", "versions"):
        out[key] = np.full((len(rows), width), GARBAGE if key == "logprobs" else 0, dtype=rows[0][key].dtype)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        out["attention_mask"][b, :n] = 1
        for key in ("input_ids", "loss_mask", "logprobs", "versions"):
            out[key][b, :n] = row[key]
    out["rewards"] = np.array([r["rewards"] for r in rows])
    return out


def areal_packed(padded) -> dict[str, np.ndarray]:
    """AReaL's pack_tensor_dict: [B, S] -> [total] by the attention mask, with cu_seqlens [B + 1]."""
    valid = padded["attention_mask"].astype(bool)
    lengths = valid.sum(axis=1)
    out = {key: padded[key][valid] for key in ("input_ids", "loss_mask", "logprobs", "versions")}
    out["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    out["max_seqlen"] = np.asarray(int(lengths.max()))
    out["rewards"] = padded["rewards"]
    return out
