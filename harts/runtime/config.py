"""Configuration of the hybrid-attention model (:class:`HybridConfig`) and its named presets.

A model is a stack of ``num_layers`` pre-norm decoder blocks. Block i has a token mixer,
``layer_types[i]`` = "linear" (a linear-attention layer of kind ``linear``: "kda" = Kimi
Delta Attention, "gdn" = Gated DeltaNet) or "full" (softmax attention of kind
``attention``: "mha", "gqa" or "mla"), and an FFN, ``mlp_layer_types[i]`` = "dense" (SwiGLU)
or "moe" (routed SwiGLU experts, optionally a shared expert).

Field names follow the Hugging Face configs of Qwen3-Next (Gated DeltaNet, gated GQA,
softmax MoE with a sigmoid-gated shared expert) and Kimi Linear (KDA, MLA, sigmoid MoE with
expert bias), so that either can be expressed:

* Qwen3-Next: ``linear="gdn", attention="gqa", attention_output_gate=True, qk_norm=True,
  partial_rotary_factor=0.25, norm_zero_centered=True, moe_router="softmax",
  shared_expert_gate=True``;
* Kimi Linear: ``linear="kda", attention="mla", use_rope=False, moe_router="sigmoid",
  moe_expert_bias=True, routed_scaling_factor=..., n_group/topk_group``.

When ``layer_types`` is not given, block i is full attention iff (i + 1) is a multiple of
``full_attention_interval``; when ``mlp_layer_types`` is not given, ``ffn="dense"`` makes
every FFN dense and ``ffn="moe"`` makes the first ``first_k_dense_replace`` blocks dense and
the rest MoE. ``num_key_value_heads`` defaults to all heads for "mha"/"mla" and to half of
them for "gqa".
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import torch

from harts.errors import HartsError

__all__ = ["CHUNK_SIZE_IS_THE_PLANS", "HybridConfig", "HybridConfigError", "PRESETS"]

logger = logging.getLogger(__name__)

LINEAR_KINDS = ("kda", "gdn")
ATTENTION_KINDS = ("mha", "gqa", "mla")
FFN_KINDS = ("dense", "moe")
ROUTER_KINDS = ("softmax", "sigmoid")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER_ALIASES = {"linear": "linear", "linear_attention": "linear", "full": "full", "full_attention": "full"}
_MLP_ALIASES = {"dense": "dense", "moe": "moe", "sparse": "moe"}


#: Why a model config takes no chunk size (one source of truth: the plan's).
CHUNK_SIZE_IS_THE_PLANS = (
    "chunk_size is not a model setting: the linear-attention chunk size is the plan's; "
    "pass it to harts.compile(batch, chunk_size=...) (or the run option chunk_size)"
)


class HybridConfigError(HartsError, ValueError):
    """A model configuration is inconsistent or names an unknown variant."""


def _dtype_name(value: Any) -> str:
    if isinstance(value, torch.dtype):
        for name, dtype in DTYPES.items():
            if dtype == value:
                return name
        raise HybridConfigError(f"dtype: {value} is not supported; use one of {sorted(DTYPES)}")
    return value


def _optional_tuple(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


@attrs.frozen(kw_only=True)
class HybridConfig:
    """Shape and variant choices of a :class:`~harts.runtime.model.HybridModel` (see module docstring)."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    layer_types: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    mlp_layer_types: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    full_attention_interval: int = 4
    first_k_dense_replace: int = 1
    linear: str = "kda"
    attention: str = "mla"
    ffn: str = "moe"

    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    norm_zero_centered: bool = False  # Qwen3-Next RMSNorm: y = x_hat * (1 + w), w initialised to 0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    dtype: str = attrs.field(default="float32", converter=_dtype_name)

    # linear attention (KDA / Gated DeltaNet); its chunk size is the plan's (harts.compile(chunk_size=...))
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    linear_conv_bias: bool = False

    # full attention (MHA / GQA)
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int = 16
    attention_bias: bool = False
    attention_output_gate: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    use_rope: bool = True
    rope_interleave: bool = False

    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    mla_latent_norm_eps: float | None = None  # eps of q_a/kv_a_layernorm; None: rms_norm_eps (Kimi Linear: 1e-6)

    # FFN
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_router: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    moe_expert_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def __attrs_post_init__(self) -> None:
        self._check_field_types()
        # Frozen class: derived fields are filled in once, here, then never change.
        if self.layer_types is None:
            interval = self.full_attention_interval
            if not isinstance(interval, int) or interval < 1:
                raise HybridConfigError(f"full_attention_interval must be a positive int, got {interval!r}")
            derived = tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(self.num_layers))
            object.__setattr__(self, "layer_types", derived)
        else:
            normalised = self._normalise(self.layer_types, _LAYER_ALIASES, "layer_types")
            object.__setattr__(self, "layer_types", tuple(normalised))
        if self.ffn not in FFN_KINDS:
            raise HybridConfigError(f"ffn must be one of {FFN_KINDS}, got {self.ffn!r}")
        if self.mlp_layer_types is None:
            if self.ffn == "dense":
                derived = ("dense",) * self.num_layers
            else:
                derived = tuple("dense" if i < self.first_k_dense_replace else "moe" for i in range(self.num_layers))
            object.__setattr__(self, "mlp_layer_types", derived)
        else:
            object.__setattr__(
                self, "mlp_layer_types", tuple(self._normalise(self.mlp_layer_types, _MLP_ALIASES, "mlp_layer_types"))
            )
        if self.num_key_value_heads is None:
            heads = self.num_attention_heads
            object.__setattr__(self, "num_key_value_heads", max(1, heads // 2) if self.attention == "gqa" else heads)
        self._validate()

    def _check_field_types(self) -> None:
        """Every int, float and bool field holds a value of its type (a YAML ``num_layers: four`` or a
        config.json ``"rope_theta": "1e4"`` is refused here, naming the field, before any arithmetic on it)."""
        for field in attrs.fields(type(self)):
            declared = str(field.type)
            value = getattr(self, field.name)
            if value is None and "None" in declared:
                continue
            kind = declared.split("|")[0].strip()
            if kind == "bool" and not isinstance(value, bool):
                raise HybridConfigError(f"{field.name} must be true or false, got {value!r}")
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise HybridConfigError(f"{field.name} must be an integer, got {value!r}")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise HybridConfigError(f"{field.name} must be a finite number, got {value!r}")
            if kind == "str" and not isinstance(value, str):
                raise HybridConfigError(f"{field.name} must be a string, got {value!r}")

    @staticmethod
    def _normalise(values, aliases, field):
        out = []
        for index, value in enumerate(values):
            if value not in aliases:
                expected = sorted(set(aliases.values()))
                raise HybridConfigError(f"{field}[{index}] is {value!r}; expected one of {expected}")
            out.append(aliases[value])
        return out

    def _validate(self) -> None:
        def fail(message):
            raise HybridConfigError(message)

        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(f"{name} must be a positive int, got {value!r}")
        if self.linear not in LINEAR_KINDS:
            fail(f"linear must be one of {LINEAR_KINDS}, got {self.linear!r}")
        if self.attention not in ATTENTION_KINDS:
            fail(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.moe_router not in ROUTER_KINDS:
            fail(f"moe_router must be one of {ROUTER_KINDS}, got {self.moe_router!r}")
        if self.dtype not in DTYPES:
            fail(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.hidden_act != "silu":
            fail(f"hidden_act: only 'silu' is implemented, got {self.hidden_act!r}")
        if len(self.layer_types) != self.num_layers:
            fail(f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}")
        if len(self.mlp_layer_types) != self.num_layers:
            fail(f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_layers is {self.num_layers}")

        if self.linear_num_value_heads % self.linear_num_key_heads:
            fail(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.linear == "kda" and self.linear_num_value_heads != self.linear_num_key_heads:
            fail(
                f"kda uses one head count for q, k and v; linear_num_key_heads ({self.linear_num_key_heads}) "
                f"!= linear_num_value_heads ({self.linear_num_value_heads})"
            )

        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if self.attention == "mha" and kv_heads != heads:
            fail(f"attention='mha' needs num_key_value_heads == num_attention_heads ({heads}), got {kv_heads}")
        if self.attention == "gqa" and (kv_heads < 1 or heads % kv_heads):
            fail(
                f"attention='gqa': num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if self.attention == "mla":
            if kv_heads != heads:
                fail(f"attention='mla' expands keys per head; num_key_value_heads must equal {heads}, got {kv_heads}")
            if self.attention_output_gate or self.qk_norm:
                fail("attention='mla' has no output gate or q/k norm (it normalises its latents); "
                     "set attention_output_gate=False and qk_norm=False")
            for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    fail(f"{name} must be a positive int for attention='mla', got {getattr(self, name)!r}")
            if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
                fail(f"qk_rope_head_dim must be a non-negative even int, got {self.qk_rope_head_dim}")
            if self.q_lora_rank is not None and self.q_lora_rank < 1:
                fail(f"q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}")
        else:
            if not 0.0 <= self.partial_rotary_factor <= 1.0:
                fail(f"partial_rotary_factor must lie in [0, 1], got {self.partial_rotary_factor}")
            if self.rotary_dim % 2:
                fail(f"rotary dims (head_dim * partial_rotary_factor = {self.rotary_dim}) must be even")

        if "moe" in self.mlp_layer_types:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    fail(f"{name} must be a positive int when a layer is MoE, got {value!r}")
            if self.num_experts_per_tok > self.num_experts:
                fail(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
            if self.num_experts % self.n_group:
                fail(f"num_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})")
            if not 1 <= self.topk_group <= self.n_group:
                fail(f"topk_group must lie in [1, n_group={self.n_group}], got {self.topk_group}")
            if self.n_group > 1:
                if self.moe_router != "sigmoid":
                    fail("grouped expert selection (n_group > 1) is defined for moe_router='sigmoid' only")
                if self.num_experts // self.n_group < 2:
                    fail("grouped expert selection scores each group by its top-2 experts; groups need >= 2 experts")
                if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                    fail("num_experts_per_tok exceeds the experts available in the topk_group selected groups")
            if self.moe_expert_bias and self.moe_router != "sigmoid":
                fail("moe_expert_bias (selection-only expert bias) is defined for moe_router='sigmoid' only")
            if self.shared_expert_gate and self.shared_expert_intermediate_size < 1:
                fail("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")

    # ------------------------------------------------------------------ derived values

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def rotary_dim(self) -> int:
        """RoPE dims of a MHA/GQA head (the leading ones); MLA rotates its qk_rope_head_dim part."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_channels(self) -> int:
        """Channels of a linear-attention layer's short convolution: its q, k and v, concatenated."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == "linear" for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(t == "moe" for t in self.mlp_layer_types)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (derived layer patterns included); ``HybridConfig.from_dict`` inverts it."""
        values = attrs.asdict(self)
        values["layer_types"] = list(self.layer_types)
        values["mlp_layer_types"] = list(self.mlp_layer_types)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> HybridConfig:
        """Inverse of :meth:`to_dict`. A ``chunk_size`` key (written by HARTS versions whose model
        config carried one) is left out: the chunk size is the plan's."""
        if "chunk_size" in values:
            logger.info("model config: 'chunk_size' left out; the linear-attention chunk size is the plan's")
            values = {k: v for k, v in values.items() if k != "chunk_size"}
        unknown = sorted(set(values) - {f.name for f in attrs.fields(cls)})
        if unknown:
            raise HybridConfigError(f"unknown config field(s) {unknown}")
        return cls(**values)

    # ------------------------------------------------------------------ presets

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> HybridConfig:
        """A named configuration with overrides (see :data:`PRESETS`).

        Switching ``attention`` away from the preset's kind also resets what only that kind
        uses (the kv-head count; the output gate and q/k norm that MLA does not have) unless
        those are overridden too. Changing ``num_layers`` without ``layer_types`` re-derives the
        layer pattern from ``full_attention_interval``.
        """
        if name not in PRESETS:
            raise HybridConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        if "chunk_size" in overrides:
            raise HybridConfigError(CHUNK_SIZE_IS_THE_PLANS)
        unknown = sorted(set(overrides) - {f.name for f in attrs.fields(cls)})
        if unknown:
            raise HybridConfigError(f"preset {name!r}: unknown config field(s) {unknown}")
        values = dict(PRESETS[name])
        attention = overrides.get("attention", values.get("attention", "mla"))
        if attention != values.get("attention"):
            values.pop("num_key_value_heads", None)
        if attention == "mla":
            values["attention_output_gate"] = False
            values["qk_norm"] = False
        else:
            values.update(PRESET_FULL_ATTENTION_EXTRAS.get(name, {}))
        if "layer_types" in overrides and "num_layers" not in overrides and overrides["layer_types"] is not None:
            overrides = {**overrides, "num_layers": len(overrides["layer_types"])}
        values.update(overrides)
        return cls(**values)


#: Base values of the named presets. "tiny" runs in seconds on CPU; "ling-3.0-tiny" has the
#: shape of Ling-3.0-tiny (paper Table 1). Values the table does not give (KDA and MLA head
#: dims, router details, shared expert) follow Kimi Linear / Ling 2.0 conventions.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        num_layers=4,
        full_attention_interval=2,
        first_k_dense_replace=1,
        linear="kda",
        attention="mla",
        ffn="moe",
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_attention_heads=4,
        head_dim=16,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_router="sigmoid",
        moe_expert_bias=True,
        routed_scaling_factor=1.5,
        shared_expert_intermediate_size=32,
        initializer_range=0.05,
    ),
    "ling-3.0-tiny": dict(
        vocab_size=157184,
        hidden_size=1536,
        num_layers=24,
        full_attention_interval=4,  # 6 x (3 KDA + 1 MLA)
        first_k_dense_replace=1,  # dense FFN in layer 1 only
        linear="kda",
        attention="mla",
        ffn="moe",
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_attention_heads=16,
        head_dim=128,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        use_rope=True,
        intermediate_size=4608,
        moe_intermediate_size=512,
        num_experts=128,
        num_experts_per_tok=8,
        moe_router="sigmoid",
        moe_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        shared_expert_intermediate_size=512,
        rms_norm_eps=1e-6,
        dtype="bfloat16",
    ),
}

#: What a preset turns on when it is switched to MHA/GQA (Qwen3-Next-style full attention).
PRESET_FULL_ATTENTION_EXTRAS: dict[str, dict[str, Any]] = {
    "tiny": dict(attention_output_gate=True, qk_norm=True, partial_rotary_factor=0.5),
    "ling-3.0-tiny": dict(),
}
