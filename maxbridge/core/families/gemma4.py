"""Gemma 4 ("gemma4", text only): Gemma 3's layer pattern with wider global heads, value norms, a per-layer scalar,
per-layer inputs and shared keys/values.

As Gemma 3, the decoder stacks blocks of six layers (`SUBLAYERS`: five
sliding-window ones, then a global one) and scans them. Gemma 4 adds:

- global layers with their own head width and key/value heads (global_head_dim,
  global_num_kv_heads, MaxText's keys) and proportional RoPE: only the first
  global_rope_proportion of each head's pairs turn, at the timescales of the
  whole head (`ops.proportional_rope`);
- an RMSNorm without a scale on the values, and attention scaled by 1 (the
  query and key norms set the logits' size); with share_kv_projections (Hugging
  Face's attention_k_eq_v) a global layer's values are its keys' projection;
- a learned scalar that multiplies each layer's output (`layer_scalar`);
- per-layer inputs (hidden_size_per_layer_input > 0): a token table of
  [vocab, layers x width] and a projection of the embedded tokens give each layer
  its own [width] input, gated by the layer's output and added back;
- shared keys/values (num_kv_shared_layers > 0): the last layers compute no keys
  or values and attend over those of the last earlier layer of their kind. They
  are a stack of their own (`kv_shared_layers`, blocks without key/value
  weights); the layers carry the shared keys/values and the per-layer inputs
  beside the hidden states (`Family.layer_carry`).

Norm scales hold Hugging Face's weights as they are (Gemma 4's RMSNorm multiplies
by w, not 1 + w); the token tables hold sqrt(width) x Hugging Face's, as Gemma's.
While decoding, the global layers cache their own wider keys/values
(`Stack.caches`) for every token, the sliding-window layers a ring of their
window (`Stack.rings`), and the KV-shared layers keep no cache: they read what
the last earlier layer of their kind read, its whole cache or ring (layers
decode unrolled).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from maxbridge.core.families import attention as attn
from maxbridge.core.families.base import Config, Family, Stack, broken, key_value_cache, query_kernel_clip
from maxbridge.core.families.gemma import MAXTEXT_GEMMA2, Scaled, embedding_scale, read_common, soft_cap
from maxbridge.core.families.hf_rules import (
    common_to_hf,
    CONFIG_FILE,
    Copy,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Part,
    Rule,
    get_bool,
    get_float,
    get_int,
)

SUBLAYERS = ("local_0", "local_1", "local_2", "local_3", "local_4", "global")  # a block's layers, in depth order
GLOBAL = "global"  # the one that attends in full
LOCAL = "local"  # the kind of the others (their shared keys/values: `SHARED_KINDS`)
SHARED_KINDS = (LOCAL, GLOBAL)
PATTERN = len(SUBLAYERS)
_LOCAL_KIND, _GLOBAL_KIND = "sliding_attention", "full_attention"  # Hugging Face's layer_types


@dataclasses.dataclass(frozen=True)
class ExpertsPart(Part):
  """Part `index` of transformers' experts.gate_up_proj [E, 2F, D] (gate, then up) <-> our wi_0 / wi_1 [E, D, F]."""

  def to_ours(self, x, shape, config):
    size = x.shape[1] // self.count
    return x[:, self.index * size : (self.index + 1) * size].swapaxes(1, 2).reshape(shape)

  def to_hf(self, x, config):
    return x.swapaxes(1, 2)


@dataclasses.dataclass(frozen=True)
class ExpertsLinear:
  """transformers' experts.down_proj [E, D, F] (each expert's torch Linear weight) <-> our wo [E, F, D]."""

  def to_ours(self, x, shape, config):
    return x.swapaxes(1, 2).reshape(shape)

  def to_hf(self, x, config):
    return x.swapaxes(1, 2)


_LAYER = "model.layers.{layer}."
RULES = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding", Scaled(embedding_scale)),
    Rule("model.norm.weight", "decoder/decoder_norm/scale", Copy()),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
    Rule(
        "model.embed_tokens_per_layer.weight",
        "decoder/per_layer_inputs/per_layer_token_embedder/embedding",
        Scaled(lambda config: math.sqrt(config.hidden_size_per_layer_input)),
    ),
    Rule(
        "model.per_layer_model_projection.weight",
        "decoder/per_layer_inputs/per_layer_model_projection/kernel",
        Linear(),
    ),
    Rule("model.per_layer_projection_norm.weight", "decoder/per_layer_inputs/per_layer_projection_norm/scale", Copy()),
    Rule(_LAYER + "input_layernorm.weight", "{layer}/pre_self_attention_norm/scale", Copy()),
    Rule(_LAYER + "post_attention_layernorm.weight", "{layer}/post_self_attention_norm/scale", Copy()),
    Rule(_LAYER + "pre_feedforward_layernorm.weight", "{layer}/pre_ffw_norm/scale", Copy()),
    Rule(_LAYER + "post_feedforward_layernorm.weight", "{layer}/post_ffw_norm/scale", Copy()),
    Rule(_LAYER + "self_attn.q_proj.weight", "{layer}/self_attention/query/kernel", Linear()),
    Rule(_LAYER + "self_attn.k_proj.weight", "{layer}/self_attention/key/kernel", Linear()),
    Rule(_LAYER + "self_attn.v_proj.weight", "{layer}/self_attention/value/kernel", Linear()),
    Rule(_LAYER + "self_attn.o_proj.weight", "{layer}/self_attention/out/kernel", Linear(in_ndim=2)),
    Rule(_LAYER + "self_attn.q_norm.weight", "{layer}/self_attention/query_norm/scale", Copy()),
    Rule(_LAYER + "self_attn.k_norm.weight", "{layer}/self_attention/key_norm/scale", Copy()),
    Rule(_LAYER + "mlp.gate_proj.weight", "{layer}/mlp/wi_0/kernel", Linear()),
    Rule(_LAYER + "mlp.up_proj.weight", "{layer}/mlp/wi_1/kernel", Linear()),
    Rule(_LAYER + "mlp.down_proj.weight", "{layer}/mlp/wo/kernel", Linear()),
    Rule(_LAYER + "per_layer_input_gate.weight", "{layer}/per_layer_input_gate/kernel", Linear()),
    Rule(_LAYER + "per_layer_projection.weight", "{layer}/per_layer_projection/kernel", Linear()),
    Rule(_LAYER + "post_per_layer_input_norm.weight", "{layer}/post_per_layer_input_norm/scale", Copy()),
    Rule(_LAYER + "layer_scalar", "{layer}/layer_scalar", Copy()),
    # The MoE variant (enable_moe_block): experts beside the MLP, their own norms, a router with its scales.
    Rule(_LAYER + "router.proj.weight", "{layer}/moe_block/gate/kernel", Linear()),
    Rule(_LAYER + "router.scale", "{layer}/moe_block/gate/scale", Copy()),
    Rule(_LAYER + "router.per_expert_scale", "{layer}/moe_block/gate/per_expert_scale", Copy()),
    Rule(_LAYER + "experts.gate_up_proj", "{layer}/moe_block/wi_0", ExpertsPart(0, 2, axis=1)),
    Rule(_LAYER + "experts.gate_up_proj", "{layer}/moe_block/wi_1", ExpertsPart(1, 2, axis=1)),
    Rule(_LAYER + "experts.down_proj", "{layer}/moe_block/wo", ExpertsLinear()),
    Rule(_LAYER + "pre_feedforward_layernorm_2.weight", "{layer}/pre_ffw_norm_2/scale", Copy()),
    Rule(_LAYER + "post_feedforward_layernorm_1.weight", "{layer}/post_ffw_norm_1/scale", Copy()),
    Rule(_LAYER + "post_feedforward_layernorm_2.weight", "{layer}/post_ffw_norm_2/scale", Copy()),
)

CONFIG_CLASS = ConfigClass(
    "Gemma4TextConfig",
    {
        "vocab_size": 262_144,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 30,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": None,
        "attention_bias": False,
        "sliding_window": 512,
        "layer_types": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": None,
        "vocab_size_per_layer_input": 262_144,
        "hidden_size_per_layer_input": 256,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
    },
    default_theta=10000.0,  # transformers' (unused: Gemma 4's RoPE is per layer kind, `_DEFAULT_ROPE`)
)
# Gemma4TextConfig's RoPE when config.json gives none: proportional on the global layers.
_DEFAULT_ROPE = {
    _LOCAL_KIND: {"rope_type": "default", "rope_theta": 10_000.0},
    _GLOBAL_KIND: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's global_head_dim when config.json gives none


def layer_kinds(layers: int) -> list[str]:
  """Hugging Face's layer_types of `layers` layers: every sixth one global."""
  return [_GLOBAL_KIND if (i + 1) % PATTERN == 0 else _LOCAL_KIND for i in range(layers)]


def global_head_dim(config: Config) -> int:
  return config.global_head_dim or config.head_dim


def global_kv_heads(config: Config) -> int:
  return config.global_num_kv_heads or config.num_kv_heads


def mlp_dim(config: Config, kv_shared: bool) -> int:
  """A layer's MLP width: twice base_mlp_dim in a KV-shared layer with use_double_wide_mlp (Gemma 4 E2B)."""
  return config.mlp_dim * (2 if kv_shared and config.use_double_wide_mlp else 1)


def rotary_pairs(config: Config) -> int:
  """How many of a global head's pairs turn (transformers' proportional RoPE: int(proportion x width // 2))."""
  return int(config.global_rope_proportion * global_head_dim(config) // 2)


def _rope(raw: Mapping[str, Any]) -> dict[str, Any]:
  parameters = raw.get("rope_parameters") or _DEFAULT_ROPE
  if not isinstance(parameters, Mapping) or set(parameters) != {_LOCAL_KIND, _GLOBAL_KIND}:
    raise HFError(
        f"{CONFIG_FILE}: rope_parameters={parameters!r} must map {_LOCAL_KIND!r} and {_GLOBAL_KIND!r} to their RoPE"
    )
  local, full = parameters[_LOCAL_KIND], parameters[_GLOBAL_KIND]
  if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFError(f"{CONFIG_FILE}: rope_parameters.{_LOCAL_KIND}={local!r}: maxbridge's gemma4 turns whole local heads")
  if full.get("rope_type") not in ("default", "proportional") or full.get("factor", 1.0) != 1.0:
    raise HFError(
        f"{CONFIG_FILE}: rope_parameters.{_GLOBAL_KIND}={full!r}: maxbridge's gemma4 implements 'default' and "
        "'proportional' RoPE without a factor there"
    )
  proportion = full.get("partial_rotary_factor", 1.0) if full["rope_type"] == "proportional" else 1.0
  return {
      "rope_type": "default",
      "rope_max_timescale": int(get_float(full, "rope_theta")),
      "local_rope_max_timescale": int(get_float(local, "rope_theta")),
      "global_rope_proportion": float(proportion),
  }


def _global_layers(raw: Mapping[str, Any], kinds: list[str]) -> dict[str, int]:
  """global_head_dim and global_num_kv_heads, read as Gemma4TextConfig builds its global layers.

  A saved config holds `per_layer_config` ({layer index: its head_dim and
  num_key_value_heads}), which must name exactly the full_attention layers, all
  alike; without it, transformers reads global_head_dim (else 512) and, with
  attention_k_eq_v, num_global_key_value_heads (else the model's).
  """
  per_layer = raw.get("per_layer_config")
  if per_layer is None:
    heads = get_int(raw, "num_global_key_value_heads", 0) or 0 if get_bool(raw, "attention_k_eq_v", False) else 0
    return {"global_head_dim": get_int(raw, "global_head_dim", _GLOBAL_HEAD_DIM), "global_num_kv_heads": heads}
  globals_ = [i for i, kind in enumerate(kinds) if kind == _GLOBAL_KIND]
  if not isinstance(per_layer, Mapping) or sorted(int(i) for i in per_layer) != globals_:
    raise HFError(
        f"{CONFIG_FILE}: per_layer_config must override exactly the full_attention layers {globals_}; "
        f"got the layers {sorted(per_layer) if isinstance(per_layer, Mapping) else per_layer!r}"
    )
  overrides = list(per_layer.values())
  if any(own != overrides[0] for own in overrides) or set(overrides[0]) - {"head_dim", "num_key_value_heads"}:
    raise HFError(
        f"{CONFIG_FILE}: per_layer_config={dict(per_layer)!r}: maxbridge's gemma4 gives every full_attention layer the "
        "same head_dim and num_key_value_heads, and nothing else of its own"
    )
  return {
      "global_head_dim": get_int(overrides[0], "head_dim", get_int(raw, "head_dim", 256)),
      "global_num_kv_heads": get_int(overrides[0], "num_key_value_heads", 0),
  }


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read({key: value for key, value in raw.items() if key != "per_layer_config"})
  layers = get_int(hf, "num_hidden_layers")
  kinds = hf["layer_types"] if hf["layer_types"] is not None else layer_kinds(layers)
  if list(kinds) != layer_kinds(layers):
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} with layer_types={kinds!r} is not supported; maxbridge's gemma4 "
        f"stacks whole blocks of {PATTERN - 1} sliding_attention layers then a full_attention one"
    )
  moe = {}
  if get_bool(hf, "enable_moe_block"):
    moe = {
        "num_experts": get_int(hf, "num_experts"),
        "num_experts_per_tok": get_int(hf, "top_k_experts"),
        "moe_mlp_dim": get_int(hf, "moe_intermediate_size"),
    }
  per_layer = get_int(hf, "hidden_size_per_layer_input", 0) or 0
  if per_layer and get_int(hf, "vocab_size_per_layer_input") != get_int(hf, "vocab_size"):
    raise HFError(
        f"{CONFIG_FILE}: vocab_size_per_layer_input={hf['vocab_size_per_layer_input']} must equal vocab_size="
        f"{hf['vocab_size']}: maxbridge's per-layer token table has the model's vocabulary"
    )
  flat = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": None}
  return {
      **read_common(flat, "gemma4", "hidden_activation"),
      **_rope(raw),
      "base_num_decoder_layers": layers,
      "use_qk_norm": True,
      "sliding_window_size": get_int(hf, "sliding_window"),
      "final_logits_soft_cap": soft_cap(hf, "final_logit_softcapping"),
      **_global_layers(raw, list(kinds)),
      "share_kv_projections": get_bool(hf, "attention_k_eq_v"),
      "hidden_size_per_layer_input": per_layer,
      "num_kv_shared_layers": get_int(hf, "num_kv_shared_layers"),
      "use_double_wide_mlp": get_bool(hf, "use_double_wide_mlp"),
      **moe,
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_max_timescale)}
  if config.global_rope_proportion != 1.0:
    full = {**full, "rope_type": "proportional", "partial_rotary_factor": config.global_rope_proportion}
  local_theta = config.local_rope_max_timescale if config.local_rope_max_timescale > 0 else config.rope_max_timescale
  values = {
      **common_to_hf(config),
      "attention_bias": False,
      "use_bidirectional_attention": None,
      "hidden_activation": "gelu_pytorch_tanh",
      "sliding_window": config.sliding_window_size,
      "layer_types": layer_kinds(config.num_decoder_layers),
      "final_logit_softcapping": config.final_logits_soft_cap or None,
      "rope_parameters": {_LOCAL_KIND: {"rope_type": "default", "rope_theta": float(local_theta)}, _GLOBAL_KIND: full},
      "attention_k_eq_v": config.share_kv_projections,
      "hidden_size_per_layer_input": config.hidden_size_per_layer_input,
      "vocab_size_per_layer_input": config.vocab_size,
      "num_kv_shared_layers": config.num_kv_shared_layers,
      "enable_moe_block": config.num_experts > 1,
      "use_double_wide_mlp": config.use_double_wide_mlp,
  }
  if config.num_experts > 1:
    values.update(
        num_experts=config.num_experts, top_k_experts=config.num_experts_per_tok, moe_intermediate_size=config.moe_mlp_dim
    )
  # As transformers saves it: the global layers' own head_dim and key/value heads, by zero-padded layer index.
  own = {
      "head_dim": global_head_dim(config),
      **({"num_key_value_heads": config.global_num_kv_heads} if config.global_num_kv_heads else {}),
  }
  width = len(str(config.num_decoder_layers - 1))
  values["per_layer_config"] = {
      f"{i:0{width}d}": dict(own) for i, kind in enumerate(values["layer_types"]) if kind == _GLOBAL_KIND
  }
  return values


def _global_cache(config: Config) -> dict[str, tuple[int, ...]]:
  """A global layer's keys and values per token: [global kv heads, global_head_dim] each."""
  shape = (global_kv_heads(config), global_head_dim(config))
  return {"cached_key": shape, "cached_value": shape}


def _check(config: Config) -> list[str]:
  layers, shared = config.num_decoder_layers, config.num_kv_shared_layers
  pattern = shared_layers = norm = window = rope = heads = others = None
  if layers % PATTERN:
    pattern = (
        f"decoder_block='gemma4' stacks blocks of {PATTERN - 1} sliding-window layers then a global one: "
        f"base_num_decoder_layers={layers} must be a multiple of {PATTERN}"
    )
  if shared % PATTERN or not 0 <= shared < layers:
    shared_layers = (
        f"num_kv_shared_layers={shared} must be a multiple of {PATTERN} (whole blocks share keys/values) below "
        f"base_num_decoder_layers={layers}, or 0"
    )
  elif config.use_double_wide_mlp and not shared:
    shared_layers = "use_double_wide_mlp=true widens the KV-shared layers' MLPs: set num_kv_shared_layers > 0"
  if not config.use_qk_norm:
    norm = "decoder_block='gemma4' normalises each head's queries and keys: set use_qk_norm=true"
  if not config.sliding_window_size:
    window = "decoder_block='gemma4' gives five of every six layers a sliding window: set sliding_window_size > 0"
  if config.rope_type != "default" or config.rope_linear_scaling_factor != 1.0:
    rope = (
        f"decoder_block='gemma4' turns its global layers by proportional RoPE (global_rope_proportion): set "
        f"rope_type='default' and rope_linear_scaling_factor=1.0 (got {config.rope_type!r}, "
        f"{config.rope_linear_scaling_factor})"
    )
  if config.num_query_heads % global_kv_heads(config):
    heads = f"global_num_kv_heads={config.global_num_kv_heads} must divide the query heads {config.num_query_heads}"
  if config.num_experts > 1 and not (config.moe_mlp_dim > 0 and config.num_experts_per_tok > 0):
    others = (
        f"decoder_block='gemma4' with num_experts={config.num_experts} (its MoE variant) needs moe_mlp_dim > 0 and "
        f"num_experts_per_tok > 0 (got {config.moe_mlp_dim}, {config.num_experts_per_tok})"
    )
  if config.mtp_num_layers or config.attn_logits_soft_cap:
    others = (
        f"decoder_block='gemma4' has no multi-token prediction nor attention soft-cap: set mtp_num_layers=0 and "
        f"attn_logits_soft_cap=0 (got {config.mtp_num_layers}, {config.attn_logits_soft_cap})"
    )
  return broken(pattern, shared_layers, norm, window, rope, heads, others)


def _window_rings(config: Config) -> dict[str, int]:
  """A sliding-window layer's decode cache: a ring of its window, which holds every key its queries may see (the
  KV-shared layers read it as it is). The global layers cache every token."""
  return {name: config.sliding_window_size for name in SUBLAYERS if name != GLOBAL}


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """Per-head query/key norms, values normed without a scale, scaled by 1; global layers have their own width,
  key/value heads and proportional RoPE; a `kv_shared` layer reads an earlier layer's keys and values."""
  if kv_shared:
    kv = attn.SHARED_KV
  else:
    kv = attn.VALUE_IS_KEY if config.share_kv_projections and not local else attn.OWN_KV
  return attn.AttentionSpec(
      head_dim=config.head_dim if local else global_head_dim(config),
      kv_heads=config.num_kv_heads if local else global_kv_heads(config),
      qk_norm=attn.RMS_NORM,
      kv=kv,
      value_norm=True,
      rope=attn.LOCAL_ROPE if local else attn.PROPORTIONAL_ROPE,
      rotary_pairs=0 if local else rotary_pairs(config),
      sliding_window_size=config.sliding_window_size if local else 0,
      ring_cache=local,
      query_scale=1.0,
      shares_kv=True,
  )


FAMILY = Family(
    decoder_blocks=("gemma4",),
    stacks=(
        Stack(
            "layers",
            "gemma4",
            depth=lambda config: (config.num_decoder_layers - config.num_kv_shared_layers) // PATTERN,
            sublayers=SUBLAYERS,
            rings=_window_rings,
            caches=lambda config: {GLOBAL: _global_cache(config)},
        ),
        Stack(
            "kv_shared_layers",
            "gemma4_kv_shared",
            depth=lambda config: config.num_kv_shared_layers // PATTERN,
            sublayers=SUBLAYERS,
            cached=False,  # they read the keys and values of the last earlier layer of their kind
        ),
    ),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # attention scales by 1: the query and key norms set the logits' size
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,  # unused: use_qk_norm refuses QK-Clip (the config's shared rule)
    hf=(
        HFFamily(
            "gemma4_text",
            "Gemma4ForCausalLM",
            ("gemma4",),
            RULES,
            _config_from_hf,
            _config_to_hf,
            CONFIG_CLASS,
            normalize_embedding_logits=True,
        ),
    ),
    check=_check,
    ring_cache=False,  # global layers are not windowed: the windowed ones keep their own rings (`_window_rings`)
    layer_rope=True,
    maxtext_fixed=MAXTEXT_GEMMA2,
    own_keys={
        "global_head_dim": 0,
        "global_num_kv_heads": 0,
        "global_rope_proportion": 1.0,
        "share_kv_projections": False,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
    },
    layer_carry="gemma4",
)
