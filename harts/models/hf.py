"""Hugging Face Qwen3-Next and Kimi Linear models as HARTS :class:`~harts.runtime.HybridModel` s.

Both architectures are expressed exactly by :class:`~harts.runtime.HybridConfig` (see the
docstring of :mod:`harts.runtime.config`); this module maps the transformers config onto it,
copies weights one to one and maps them back:

* ``qwen3_next`` (``Qwen3NextForCausalLM``): Gated DeltaNet + gated GQA with q/k norm and
  partial RoPE, zero-centred RMSNorm, softmax-routed MoE with a sigmoid-gated shared expert.
  An FFN is MoE iff ``i not in mlp_only_layers`` and ``num_experts > 0`` and
  ``(i + 1) % decoder_sparse_step == 0``.
* ``kimi_linear`` (``KimiLinearForCausalLM``): KDA + MLA without rotation (NoPE), RMSNorm,
  sigmoid-routed MoE with a selection-only expert bias, grouped selection and an ungated
  shared expert of width ``moe_intermediate_size * n_shared_experts``; FFN kinds come from
  ``mlp_layer_types``. The MLA latent norms use eps 1e-6 whatever ``rms_norm_eps`` is, as
  in transformers.

Parameter names equal the transformers ones after dropping the ``model.`` prefix, except
that Kimi Linear calls both mixers ``self_attn`` (HARTS: ``linear_attn`` on KDA layers) and
its shared expert ``shared_experts``. The linear-attention chunk size of the returned model
defaults to 64, the chunk size of the transformers torch kernels; the chunking is exact, so
any chunk size gives the same function.

The embedding keeps transformers' ``padding_idx`` (``pad_token_id``), so the padding row
gets no gradient in either. Precision: transformers runs norms, RoPE tables, attention
softmax, routers and the whole linear-attention core in float32 even in a float64 model;
HARTS keeps float64 throughout. In float64 the two therefore agree to float32 round-off only,
and to float64 round-off once those downcasts are lifted (see ``tests/runtime/test_hf_models.py``).

transformers is imported only to read a local path (:func:`from_hf`) or to build a
transformers config (:func:`to_hf_config`); nothing in :mod:`harts.runtime` imports it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

from harts.errors import HartsError
from harts.runtime.config import CHUNK_SIZE_IS_THE_PLANS, HybridConfig, HybridConfigError
from harts.runtime.layers import ShortConvolution
from harts.runtime.model import HybridModel

logger = logging.getLogger(__name__)

__all__ = [
    "ARCHITECTURES",
    "HFModelError",
    "HFSource",
    "from_hf",
    "hf_key_map",
    "hybrid_config_from_hf",
    "to_hf_config",
    "to_hf_state_dict",
]

QWEN3_NEXT = "qwen3_next"
KIMI_LINEAR = "kimi_linear"

#: model_type -> the transformers causal-LM class HARTS reproduces.
ARCHITECTURES: dict[str, str] = {QWEN3_NEXT: "Qwen3NextForCausalLM", KIMI_LINEAR: "KimiLinearForCausalLM"}

#: The eps transformers hard-codes for Kimi Linear's MLA latent norms (q_a/kv_a_layernorm).
KIMI_MLA_LATENT_NORM_EPS = 1e-6

#: HybridConfig fields each architecture fixes; a HybridModel exported to it must have these values.
_FIXED_FIELDS: dict[str, dict[str, Any]] = {
    QWEN3_NEXT: dict(
        linear="gdn", attention_output_gate=True, qk_norm=True, norm_zero_centered=True, use_rope=True,
        rope_interleave=False, linear_conv_bias=False, hidden_act="silu",
    ),
    KIMI_LINEAR: dict(
        linear="kda", attention="mla", use_rope=False, norm_zero_centered=False, linear_conv_bias=False,
        hidden_act="silu", mla_latent_norm_eps=KIMI_MLA_LATENT_NORM_EPS, attention_output_gate=False, qk_norm=False,
    ),
}

#: The same for models with MoE layers (HybridConfig rejects router settings on a dense model).
_FIXED_MOE_FIELDS: dict[str, dict[str, Any]] = {
    QWEN3_NEXT: dict(
        moe_router="softmax", moe_expert_bias=False, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        shared_expert_gate=True,
    ),
    KIMI_LINEAR: dict(moe_router="sigmoid", moe_expert_bias=True, shared_expert_gate=False),
}


class HFModelError(HartsError, ValueError):
    """A Hugging Face model, config or state dict that HARTS cannot reproduce exactly; names the field or module."""


@attrs.frozen
class HFSource:
    """What :func:`from_hf` remembers about the transformers model a HybridModel came from.

    ``dtypes`` maps transformers state-dict keys to their dtypes, so that
    :func:`to_hf_state_dict` returns tensors of the original dtypes where HARTS keeps a
    tensor in a wider one (routers, decay biases). ``config`` is the transformers config as
    a dict, so that :func:`harts.models.save_pretrained` keeps what HARTS does not model
    (token ids, ``max_position_embeddings``, ...).
    """

    architecture: str
    dtypes: Mapping[str, torch.dtype] = attrs.field(factory=dict)
    config: Mapping[str, Any] = attrs.field(factory=dict)


# --------------------------------------------------------------------------- config mapping


def _model_type(hf_config: Any) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ARCHITECTURES:
        architectures = getattr(hf_config, "architectures", None)
        raise HFModelError(
            f"model_type {model_type!r} (architectures={architectures}) is not supported; "
            f"HARTS loads {sorted(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())})"
        )
    return model_type


def _field(hf_config: Any, name: str, model_type: str) -> Any:
    if not hasattr(hf_config, name):
        raise HFModelError(f"{model_type} config has no field {name!r}")
    return getattr(hf_config, name)


def _positive_int(hf_config: Any, name: str, model_type: str, *, allow_zero: bool = False) -> int:
    value = _field(hf_config, name, model_type)
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a non-negative" if allow_zero else "a positive"
        raise HFModelError(f"{model_type} config field {name!r} must be {kind} int, got {value!r}")
    return value


def _dtype_name(value: Any, where: str) -> str:
    if value is None:
        return "float32"
    if isinstance(value, str):
        value = getattr(torch, value, value)
    names = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if value not in names:
        raise HFModelError(f"{where}: dtype {value!r} is not supported; use one of {sorted(names.values())}")
    return names[value]


def _layer_types(hf_config: Any, model_type: str) -> list[str]:
    layers = _positive_int(hf_config, "num_hidden_layers", model_type)
    layer_types = list(_field(hf_config, "layer_types", model_type) or [])
    if len(layer_types) != layers:
        raise HFModelError(
            f"{model_type} config field 'layer_types' has {len(layer_types)} entries but num_hidden_layers is {layers}"
        )
    out = []
    for index, kind in enumerate(layer_types):
        if kind not in ("linear_attention", "full_attention"):
            raise HFModelError(
                f"{model_type} config field 'layer_types[{index}]' is {kind!r}; HARTS implements "
                "'linear_attention' and 'full_attention' layers only"
            )
        out.append("linear" if kind == "linear_attention" else "full")
    return out


def _common_checks(hf_config: Any, model_type: str) -> None:
    act = _field(hf_config, "hidden_act", model_type)
    if act != "silu":
        raise HFModelError(f"{model_type} config field 'hidden_act' is {act!r}; HARTS implements 'silu' only")
    dropout = getattr(hf_config, "attention_dropout", 0.0) or 0.0
    if dropout != 0.0:
        raise HFModelError(
            f"{model_type} config field 'attention_dropout' is {dropout}; HARTS has no attention dropout, "
            "so training would differ from transformers (set it to 0.0)"
        )
    if getattr(hf_config, "use_sliding_window", False) or getattr(hf_config, "sliding_window", None):
        raise HFModelError(f"{model_type} config field 'sliding_window' is set; HARTS has no sliding-window attention")


def _rope(hf_config: Any, model_type: str) -> tuple[float, float]:
    rope = getattr(hf_config, "rope_parameters", None)
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFModelError(
            f"{model_type} config field \"rope_parameters['rope_type']\" is {rope_type!r}; HARTS implements "
            "the 'default' rotary embedding only (no RoPE scaling)"
        )
    theta = rope.get("rope_theta")
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise HFModelError(f"{model_type} config field \"rope_parameters['rope_theta']\" must be positive, got {theta!r}")
    factor = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def _qwen3_next_fields(hf_config: Any) -> dict[str, Any]:
    t = QWEN3_NEXT
    layers = _positive_int(hf_config, "num_hidden_layers", t)
    heads = _positive_int(hf_config, "num_attention_heads", t)
    kv_heads = _positive_int(hf_config, "num_key_value_heads", t)
    hidden = _positive_int(hf_config, "hidden_size", t)
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    theta, partial = _rope(hf_config, t)
    step = _positive_int(hf_config, "decoder_sparse_step", t)
    num_experts = _positive_int(hf_config, "num_experts", t, allow_zero=True)
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    mlp_layer_types = [
        "moe" if (i not in mlp_only and num_experts > 0 and (i + 1) % step == 0) else "dense" for i in range(layers)
    ]
    fields = dict(
        vocab_size=_positive_int(hf_config, "vocab_size", t),
        hidden_size=hidden,
        num_layers=layers,
        layer_types=_layer_types(hf_config, t),
        mlp_layer_types=mlp_layer_types,
        attention="mha" if kv_heads == heads else "gqa",
        ffn="moe" if "moe" in mlp_layer_types else "dense",
        rms_norm_eps=float(_field(hf_config, "rms_norm_eps", t)),
        initializer_range=float(getattr(hf_config, "initializer_range", 0.02)),
        linear_num_key_heads=_positive_int(hf_config, "linear_num_key_heads", t),
        linear_num_value_heads=_positive_int(hf_config, "linear_num_value_heads", t),
        linear_key_head_dim=_positive_int(hf_config, "linear_key_head_dim", t),
        linear_value_head_dim=_positive_int(hf_config, "linear_value_head_dim", t),
        linear_conv_kernel_dim=_positive_int(hf_config, "linear_conv_kernel_dim", t),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        rope_theta=theta,
        partial_rotary_factor=partial,
        intermediate_size=_positive_int(hf_config, "intermediate_size", t),
        **_FIXED_FIELDS[QWEN3_NEXT],
    )
    if "moe" in mlp_layer_types:
        shared = _positive_int(hf_config, "shared_expert_intermediate_size", t, allow_zero=True)
        if shared == 0:
            raise HFModelError(
                "qwen3_next config field 'shared_expert_intermediate_size' is 0; the transformers MoE block always "
                "adds a gated shared expert, HARTS needs it to have a positive width"
            )
        fields.update(
            moe_intermediate_size=_positive_int(hf_config, "moe_intermediate_size", t),
            num_experts=num_experts,
            num_experts_per_tok=_positive_int(hf_config, "num_experts_per_tok", t),
            norm_topk_prob=bool(_field(hf_config, "norm_topk_prob", t)),
            shared_expert_intermediate_size=shared,
            **_FIXED_MOE_FIELDS[QWEN3_NEXT],
        )
    return fields


def _kimi_linear_fields(hf_config: Any) -> dict[str, Any]:
    t = KIMI_LINEAR
    layers = _positive_int(hf_config, "num_hidden_layers", t)
    heads = _positive_int(hf_config, "num_attention_heads", t)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise HFModelError(
            f"kimi_linear config field 'num_key_value_heads' is {kv_heads}; its MLA expands keys to every head, "
            f"so HARTS needs num_key_value_heads == num_attention_heads ({heads})"
        )
    mlp_kinds = list(_field(hf_config, "mlp_layer_types", t) or [])
    if len(mlp_kinds) != layers:
        raise HFModelError(
            f"kimi_linear config field 'mlp_layer_types' has {len(mlp_kinds)} entries but num_hidden_layers is {layers}"
        )
    mlp_layer_types = []
    for index, kind in enumerate(mlp_kinds):
        if kind not in ("dense", "sparse"):
            raise HFModelError(
                f"kimi_linear config field 'mlp_layer_types[{index}]' is {kind!r}; expected 'dense' or 'sparse'"
            )
        mlp_layer_types.append("moe" if kind == "sparse" else "dense")
    q_lora_rank = getattr(hf_config, "q_lora_rank", None)
    if q_lora_rank is not None:
        q_lora_rank = _positive_int(hf_config, "q_lora_rank", t)
    nope = _positive_int(hf_config, "qk_nope_head_dim", t)
    rope_dims = _positive_int(hf_config, "qk_rope_head_dim", t, allow_zero=True)
    heads_dim = _positive_int(hf_config, "linear_head_dim", t)
    linear_heads = _positive_int(hf_config, "linear_num_heads", t)
    fields = dict(
        vocab_size=_positive_int(hf_config, "vocab_size", t),
        hidden_size=_positive_int(hf_config, "hidden_size", t),
        num_layers=layers,
        layer_types=_layer_types(hf_config, t),
        mlp_layer_types=mlp_layer_types,
        ffn="moe" if "moe" in mlp_layer_types else "dense",
        rms_norm_eps=float(_field(hf_config, "rms_norm_eps", t)),
        initializer_range=float(getattr(hf_config, "initializer_range", 0.02)),
        linear_num_key_heads=linear_heads,
        linear_num_value_heads=linear_heads,
        linear_key_head_dim=heads_dim,
        linear_value_head_dim=heads_dim,
        linear_conv_kernel_dim=_positive_int(hf_config, "linear_conv_kernel_dim", t),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=nope + rope_dims,
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        q_lora_rank=q_lora_rank,
        kv_lora_rank=_positive_int(hf_config, "kv_lora_rank", t),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dims,
        v_head_dim=_positive_int(hf_config, "v_head_dim", t),
        intermediate_size=_positive_int(hf_config, "intermediate_size", t),
        **_FIXED_FIELDS[KIMI_LINEAR],
    )
    if "moe" in mlp_layer_types:
        moe_width = _positive_int(hf_config, "moe_intermediate_size", t)
        num_experts = _positive_int(hf_config, "num_local_experts", t)
        n_group = _positive_int(hf_config, "n_group", t)
        topk_group = _positive_int(hf_config, "topk_group", t)
        if num_experts % n_group or num_experts // n_group < 2:
            raise HFModelError(
                f"kimi_linear config field 'n_group' is {n_group}: num_local_experts ({num_experts}) must split into "
                "n_group groups of at least 2 experts (each group is scored by its top-2 experts)"
            )
        fields.update(
            moe_intermediate_size=moe_width,
            num_experts=num_experts,
            num_experts_per_tok=_positive_int(hf_config, "num_experts_per_tok", t),
            norm_topk_prob=bool(_field(hf_config, "norm_topk_prob", t)),
            routed_scaling_factor=float(_field(hf_config, "routed_scaling_factor", t)),
            n_group=n_group,
            topk_group=topk_group,
            shared_expert_intermediate_size=moe_width * _positive_int(hf_config, "n_shared_experts", t, allow_zero=True),
            **_FIXED_MOE_FIELDS[KIMI_LINEAR],
        )
    return fields


def hybrid_config_from_hf(hf_config: Any, *, dtype: Any = None) -> HybridConfig:
    """The :class:`HybridConfig` of a transformers Qwen3-Next or Kimi Linear config.

    ``dtype`` defaults to the config's ``dtype`` (float32 when unset). Raises :class:`HFModelError` naming the
    field for anything HARTS does not reproduce exactly.
    """
    model_type = _model_type(hf_config)
    _common_checks(hf_config, model_type)
    fields = _qwen3_next_fields(hf_config) if model_type == QWEN3_NEXT else _kimi_linear_fields(hf_config)
    # `torch_dtype` is the pre-v5 name; reading it on a v5 config only logs a deprecation
    config_dtype = getattr(hf_config, "dtype", None) if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
    fields["dtype"] = _dtype_name(dtype if dtype is not None else config_dtype, f"{model_type} config field 'dtype'")
    fields["tie_word_embeddings"] = _ties_embeddings(hf_config, model_type)
    try:
        return HybridConfig(**fields)
    except HybridConfigError as error:
        raise HFModelError(f"{model_type} config is not supported: {error}") from error


def _ties_embeddings(hf_config: Any, model_type: str) -> bool:
    # Kimi Linear's transformers class declares no tied keys: its lm_head is never tied.
    return bool(getattr(hf_config, "tie_word_embeddings", False)) and model_type == QWEN3_NEXT


# --------------------------------------------------------------------------- names


def _architecture_of(config: HybridConfig, architecture: str | None) -> str:
    if architecture is not None:
        if architecture not in ARCHITECTURES:
            raise HFModelError(f"architecture {architecture!r} is not supported; use one of {sorted(ARCHITECTURES)}")
        chosen = architecture
    elif config.linear == "gdn":
        chosen = QWEN3_NEXT
    elif config.linear == "kda" and config.attention == "mla":
        chosen = KIMI_LINEAR
    else:
        raise HFModelError(
            f"cannot infer a transformers architecture for linear={config.linear!r}, attention={config.attention!r}; "
            f"pass architecture= one of {sorted(ARCHITECTURES)}"
        )
    if chosen == QWEN3_NEXT and config.attention not in ("mha", "gqa"):
        raise HFModelError(f"qwen3_next needs attention 'mha' or 'gqa', the model has attention={config.attention!r}")
    fixed = dict(_FIXED_FIELDS[chosen])
    if config.num_moe_layers:
        fixed.update(_FIXED_MOE_FIELDS[chosen])
    for name, value in fixed.items():
        actual = getattr(config, name)
        if name == "mla_latent_norm_eps" and actual is None:
            actual = config.rms_norm_eps  # what the latent norms use when the field is unset
        if actual != value:
            raise HFModelError(
                f"the model's config field {name!r} is {actual!r}; {chosen} ({ARCHITECTURES[chosen]}) needs {value!r}"
            )
    if chosen == KIMI_LINEAR and config.linear_key_head_dim != config.linear_value_head_dim:
        raise HFModelError(
            f"kimi_linear has one linear head dim; the model's config has linear_key_head_dim "
            f"{config.linear_key_head_dim} != linear_value_head_dim {config.linear_value_head_dim}"
        )
    return chosen


def _hf_key(key: str, architecture: str) -> str:
    if key.startswith("lm_head."):
        return key
    if architecture == KIMI_LINEAR:
        key = key.replace(".mlp.shared_expert.", ".mlp.shared_experts.").replace(".linear_attn.", ".self_attn.")
    return "model." + key


def hf_key_map(model: HybridModel, architecture: str | None = None) -> dict[str, str]:
    """HARTS state-dict (and parameter) name -> transformers name, for every entry of ``model.state_dict()``."""
    chosen = _architecture_of(model.config, architecture or _source_architecture(model))
    return {key: _hf_key(key, chosen) for key in model.state_dict()}


def _source_architecture(model: nn.Module) -> str | None:
    source = getattr(model, "hf_source", None)
    return source.architecture if isinstance(source, HFSource) else None


# --------------------------------------------------------------------------- from_hf


def from_hf(source: Any, *, dtype: Any = None, **unsupported: Any) -> HybridModel:
    """A :class:`HybridModel` with the math and weights of a transformers Qwen3-Next or Kimi Linear model.

    ``source`` is a model instance (``Qwen3NextForCausalLM`` / ``KimiLinearForCausalLM``;
    weights are copied, the returned model lives on the same device), a transformers
    config (a freshly initialised model with the transformers initialisation scheme) or a
    local directory (``from_pretrained(..., local_files_only=True)``; a directory without
    weights is read as a config). ``dtype`` overrides the dtype of a config or a path. The
    linear-attention chunk size is not the model's but the plan's (``harts.compile(chunk_size=...)``):
    ``chunk_size=`` here is refused.
    """
    if "chunk_size" in unsupported:
        raise HFModelError(f"from_hf: {CHUNK_SIZE_IS_THE_PLANS}")
    if unsupported:
        raise HFModelError(f"from_hf: unknown option(s) {sorted(unsupported)}; it takes dtype=")
    if isinstance(source, (str, os.PathLike)):
        return _from_path(os.fspath(source), dtype=dtype)
    if isinstance(source, nn.Module):
        if dtype is not None:
            raise HFModelError("from_hf(model): dtype= applies to configs and paths; cast the transformers model instead")
        return _from_model(source)
    if hasattr(source, "model_type") and hasattr(source, "to_dict"):
        return _from_config(source, dtype=dtype)
    raise HFModelError(
        f"from_hf expects a transformers model, a transformers config or a local path, got {type(source).__name__}"
    )


def _from_path(path: str, *, dtype: Any) -> HybridModel:
    if not os.path.isdir(path):
        raise HFModelError(f"from_hf: {path!r} is not a local directory (HARTS loads local files only)")
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise HFModelError(f"from_hf: {path} holds no config.json; give a Hugging Face checkpoint directory")
    # transformers reports a bad checkpoint with a dozen exception types (OSError, ValueError, KeyError,
    # safetensors' own, torch's unpickling refusals...): each becomes an HFModelError naming the directory.
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - see above
        raise HFModelError(f"from_hf: {path}: cannot read its config.json ({_short(error)})") from None
    _model_type(hf_config)
    weight_files = [name for name in os.listdir(path) if name.endswith((".safetensors", ".bin", ".safetensors.index.json"))]
    if not weight_files:
        logger.info("from_hf: %s holds a config only; building a freshly initialised model", path)
        return _from_config(hf_config, dtype=dtype)
    kwargs = {"dtype": getattr(torch, _dtype_name(dtype, "dtype="))} if dtype is not None else {}
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    except Exception as error:  # noqa: BLE001 - see above
        raise HFModelError(
            f"from_hf: {path}: cannot load the weights ({_short(error)}); HARTS reads safetensors checkpoints "
            "that match their config.json (a .bin checkpoint must be one torch can load with weights_only=True)"
        ) from None
    return _from_model(hf_model)


def _short(error: Exception) -> str:
    """An exception as one short line: transformers' messages run to paragraphs."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _from_config(hf_config: Any, *, dtype: Any) -> HybridModel:
    config = hybrid_config_from_hf(hf_config, dtype=dtype)
    model = HybridModel(config)
    pad = getattr(hf_config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
    with torch.no_grad():
        # HybridModel initialises as transformers does, except for two details fixed here:
        # transformers draws conv weights from normal(0, initializer_range) and zeroes the padding row.
        for module in model.modules():
            if isinstance(module, ShortConvolution):
                module.weight.normal_(0.0, config.initializer_range)
                if module.bias is not None:
                    module.bias.zero_()
        if pad is not None:
            model.embed_tokens.weight[pad].zero_()
    model.embed_tokens.padding_idx = pad
    model.hf_source = HFSource(_model_type(hf_config), config=hf_config.to_dict())
    return model


def _hf_dtype_of(module: nn.Module) -> torch.dtype:
    embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    if embeddings is None or not hasattr(embeddings, "weight"):
        raise HFModelError(f"{type(module).__name__} has no input embeddings; from_hf needs a causal LM")
    return embeddings.weight.dtype


def _from_model(hf_model: nn.Module) -> HybridModel:
    config, model_type = checked_hf_config(hf_model)
    device = hf_model.lm_head.weight.device
    with torch.device(device):
        model = HybridModel(config)
    mapped = mapped_hf_state(hf_model, model, model_type)
    with torch.no_grad():
        model.load_state_dict(mapped, strict=True)
    finish_from_hf(model, hf_model, model_type)
    return model


def checked_hf_config(hf_model: nn.Module, **options: Any) -> tuple[HybridConfig, str]:
    """The HybridConfig of a transformers model instance, after checking its class and modules; and its model_type.

    ``options`` go to :func:`hybrid_config_from_hf` (its dtype is the model's).
    """
    hf_config = getattr(hf_model, "config", None)
    if hf_config is None:
        raise HFModelError(f"{type(hf_model).__name__} is not a transformers model (it has no .config)")
    model_type = _model_type(hf_config)
    expected_class = ARCHITECTURES[model_type]
    if type(hf_model).__name__ != expected_class or not isinstance(getattr(hf_model, "lm_head", None), nn.Linear):
        raise HFModelError(
            f"from_hf needs a {expected_class} (a causal LM with an nn.Linear lm_head); got module "
            f"{type(hf_model).__name__}"
        )
    hf_dtype = _hf_dtype_of(hf_model)
    config = hybrid_config_from_hf(hf_config, dtype=hf_dtype, **options)
    tied = hf_model.lm_head.weight is hf_model.get_input_embeddings().weight
    if tied != config.tie_word_embeddings:
        config = attrs.evolve(config, tie_word_embeddings=tied)
    _check_modules(hf_model, model_type)
    return config, model_type


def mapped_hf_state(hf_model: nn.Module, model: HybridModel, model_type: str, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """HARTS state name -> the transformers tensor of that entry (the Parameter itself with ``keep_vars``).

    Raises :class:`HFModelError` for state HARTS has no counterpart for, state it lacks, or a shape
    that differs from the one ``model``'s config gives.
    """
    hf_state = hf_model.state_dict(keep_vars=keep_vars)
    names = hf_key_map(model, model_type)
    inverse = {hf: ours for ours, hf in names.items()}
    unexpected = []
    for hf_key, tensor in hf_state.items():
        if hf_key in inverse:
            continue
        # Kimi Linear with n_shared_experts = 0 carries a zero-width shared MLP that adds nothing.
        if model_type == KIMI_LINEAR and ".mlp.shared_experts." in hf_key and tensor.numel() == 0:
            continue
        unexpected.append(hf_key)
    if unexpected:
        raise HFModelError(
            f"{type(hf_model).__name__} has state {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} that "
            f"HARTS has no counterpart for (module {unexpected[0].rsplit('.', 1)[0]!r}); adapters, quantised or "
            "modified modules are not supported"
        )
    missing = [hf for hf in names.values() if hf not in hf_state]
    if missing:
        raise HFModelError(f"{type(hf_model).__name__} lacks {missing[:5]} that the HARTS model of its config has")
    ours_state = model.state_dict()
    mapped = {}
    for ours, hf in names.items():
        tensor = hf_state[hf]
        if tuple(tensor.shape) != tuple(ours_state[ours].shape):
            raise HFModelError(
                f"{type(hf_model).__name__} state {hf!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(ours_state[ours].shape)} from its config"
            )
        mapped[ours] = tensor
    return mapped


def finish_from_hf(model: HybridModel, hf_model: nn.Module, model_type: str) -> None:
    """What a HybridModel made from ``hf_model`` takes over besides weights: padding row, provenance, train mode."""
    model.embed_tokens.padding_idx = hf_model.get_input_embeddings().padding_idx
    dtypes = {key: tensor.dtype for key, tensor in hf_model.state_dict().items()}
    model.hf_source = HFSource(model_type, dtypes, hf_model.config.to_dict())
    model.train(hf_model.training)


def _check_modules(hf_model: nn.Module, model_type: str) -> None:
    """Reject modules whose math HARTS does not reproduce even though their weights would load."""
    prefix = "Qwen3Next" if model_type == QWEN3_NEXT else "KimiLinear"
    allowed = (nn.Linear, nn.Embedding, nn.Conv1d, nn.ModuleList, nn.Dropout, nn.Identity)
    for name, module in hf_model.named_modules():
        if name == "" or type(module) in allowed:
            continue
        kind = type(module).__name__
        if not kind.startswith(prefix) and not kind.startswith("SiLU"):
            raise HFModelError(
                f"{type(hf_model).__name__} module {name!r} is a {kind}, which is not part of the transformers "
                f"{ARCHITECTURES[model_type]}; HARTS cannot reproduce it"
            )
        if isinstance(module, nn.Conv1d) and module.bias is not None:
            raise HFModelError(f"module {name!r}: a short convolution with a bias is not part of {model_type}")


# --------------------------------------------------------------------------- back to transformers


def _hf_tensor_dtype(hf_key: str, tensor: torch.Tensor, model: HybridModel, architecture: str) -> torch.dtype:
    source = getattr(model, "hf_source", None)
    if isinstance(source, HFSource) and hf_key in source.dtypes:
        return source.dtypes[hf_key]
    if architecture == QWEN3_NEXT and hf_key.endswith(".mlp.gate.weight"):
        return model.dtype  # Qwen3-Next keeps its router in the model dtype; HARTS widens it
    return tensor.dtype


def to_hf_state_dict(model: HybridModel, architecture: str | None = None) -> dict[str, torch.Tensor]:
    """The state dict of ``model`` in the transformers layout of ``architecture``.

    ``architecture`` ("qwen3_next" or "kimi_linear") defaults to the one the model was
    loaded from, else is inferred from the config (Gated DeltaNet -> Qwen3-Next, KDA + MLA ->
    Kimi Linear). ``to_hf_state_dict(from_hf(m))`` equals ``m.state_dict()`` key for key and
    bit for bit (tied weights appear under both names, as in transformers).
    """
    chosen = _architecture_of(model.config, architecture or _source_architecture(model))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        hf_key = _hf_key(key, chosen)
        out[hf_key] = tensor.detach().to(_hf_tensor_dtype(hf_key, tensor, model, chosen))
    if chosen == KIMI_LINEAR and model.config.shared_expert_intermediate_size == 0:
        _add_empty_kimi_shared_experts(out, model)
    return out


def _add_empty_kimi_shared_experts(out: dict[str, torch.Tensor], model: HybridModel) -> None:
    hidden = model.config.hidden_size
    for index, kind in enumerate(model.config.mlp_layer_types):
        if kind != "moe":
            continue
        base = f"model.layers.{index}.mlp.shared_experts."
        device = model.embed_tokens.weight.device
        for name, shape in (("gate_proj", (0, hidden)), ("up_proj", (0, hidden)), ("down_proj", (hidden, 0))):
            key = base + name + ".weight"
            out[key] = torch.empty(shape, dtype=_hf_tensor_dtype(key, model.embed_tokens.weight, model, KIMI_LINEAR), device=device)


def to_hf_config(config: HybridConfig, architecture: str | None = None, **extra: Any):
    """A transformers config (``Qwen3NextConfig`` / ``KimiLinearConfig``) describing ``config``.

    ``extra`` is passed on to the transformers config (token ids, ``max_position_embeddings`` ...).
    """
    chosen = _architecture_of(config, architecture)
    layer_types = ["linear_attention" if kind == "linear" else "full_attention" for kind in config.layer_types]
    moe = config.num_moe_layers > 0
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        hidden_act=config.hidden_act,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        layer_types=layer_types,
        dtype=config.dtype,
    )
    if chosen == QWEN3_NEXT:
        from transformers import Qwen3NextConfig

        values = dict(
            common,
            head_dim=config.head_dim,
            rope_parameters={
                "rope_type": "default", "rope_theta": config.rope_theta,
                "partial_rotary_factor": config.partial_rotary_factor,
            },
            linear_conv_kernel_dim=config.linear_conv_kernel_dim,
            linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim,
            linear_num_key_heads=config.linear_num_key_heads,
            linear_num_value_heads=config.linear_num_value_heads,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, kind in enumerate(config.mlp_layer_types) if kind == "dense"],
            num_experts=config.num_experts if moe else 0,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            shared_expert_intermediate_size=config.shared_expert_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
        )
        values.update(extra)
        return Qwen3NextConfig(**values)
    from transformers import KimiLinearConfig

    shared = config.shared_expert_intermediate_size
    if moe and shared % config.moe_intermediate_size:
        raise HFModelError(
            f"kimi_linear sizes its shared expert as n_shared_experts * moe_intermediate_size; "
            f"shared_expert_intermediate_size {shared} is not a multiple of {config.moe_intermediate_size}"
        )
    if config.tie_word_embeddings:
        raise HFModelError("kimi_linear never ties lm_head to the embeddings; tie_word_embeddings must be False")
    values = dict(
        common,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        linear_head_dim=config.linear_key_head_dim,
        linear_num_heads=config.linear_num_key_heads,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        mlp_layer_types=["sparse" if kind == "moe" else "dense" for kind in config.mlp_layer_types],
        moe_intermediate_size=config.moe_intermediate_size,
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        n_shared_experts=shared // config.moe_intermediate_size if moe else 1,
        routed_scaling_factor=config.routed_scaling_factor,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    values.update(extra)
    return KimiLinearConfig(**values)
