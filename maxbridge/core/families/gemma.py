"""Gemma 1 ("gemma") and Gemma 2 ("gemma2"): GeGLU MLPs, a tied head, Gemma 2's soft-caps and alternating windows.

Canonical parameters follow MaxText's Gemma checkpoints, so those read as they
are: the token table holds sqrt(emb_dim) x Hugging Face's embedding (the input
needs no scaling, and the tied head divides by sqrt(emb_dim) again:
`normalize_embedding_logits`, MaxText's default), norm scales hold Hugging
Face's (1 + w), and the query kernel carries attention's scale. The Hugging
Face rules convert at the boundary.

Gemma 2 alternates a sliding-window layer and a global one. As in MaxText, a
stacked layer is a block of the two, so `base_num_decoder_layers` counts blocks:
half of Hugging Face's `num_hidden_layers`. The block is MaxText's
Gemma2DecoderLayer: one scope whose module names end in their sub-layer
(`pre_self_attention_norm_local`, `self_attention_global`, `mlp_local`, ...), so
MaxText's gemma2 checkpoints (scanned `decoder/layers/...`, unscanned
`decoder/layers_<i>/...`) load as they are.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from maxbridge.core.families import attention as attn
from maxbridge.core.families import llama
from maxbridge.core.families.base import (
    Config,
    Family,
    Stack,
    broken,
    key_value_cache,
    query_kernel_clip,
)
from maxbridge.core.families.hf_rules import (
    common_to_hf,
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Rule,
    get,
    get_bool,
    get_float,
    get_int,
    head_dim,
    require,
    require_one_of,
    rope_from_hf,
    rope_to_hf,
)

# transformers' names for GELU's tanh approximation, the one GeGLU computes here.
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_python_tanh", "gelu_fast")


@dataclasses.dataclass(frozen=True)
class Scaled:
  """Same shape, times `factor(cfg)` on import (divided on export): the token table's sqrt(emb_dim)."""

  factor: Callable[[Config], float]

  def to_ours(self, x, shape, config):
    return x.reshape(shape) * self.factor(config)

  def to_hf(self, x, config):
    return x / self.factor(config)


@dataclasses.dataclass(frozen=True)
class PlusOne:
  """Hugging Face's Gemma RMSNorm weight w multiplies by (1 + w); MaxText's scale is that (1 + w)."""

  def to_ours(self, x, shape, config):
    return x.reshape(shape) + 1

  def to_hf(self, x, config):
    return x - 1


def embedding_scale(config: Config) -> float:
  return math.sqrt(config.emb_dim)


def query_pre_attn_scalar(config: Config) -> int:
  """What attention divides the query by the square root of (Hugging Face's query_pre_attn_scalar; 0: head_dim)."""
  return config.query_pre_attn_scalar or config.head_dim


def _query_scale(config: Config) -> float:
  return query_pre_attn_scalar(config) ** -0.5


_QUERY_RULE = Rule("model.layers.{layer}.self_attn.q_proj.weight", "{layer}/self_attention/query/kernel")
_ATTENTION_RULES = (
    Rule(_QUERY_RULE.hf, _QUERY_RULE.ours, Linear(scale=_query_scale)),
    *(rule for rule in llama.ATTENTION_RULES if rule.hf != _QUERY_RULE.hf and "norm" not in rule.hf),
)
_COMMON_RULES = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding", Scaled(embedding_scale)),
    Rule("model.norm.weight", "decoder/decoder_norm/scale", PlusOne()),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
)
GEMMA_RULES = (
    *_COMMON_RULES,
    Rule("model.layers.{layer}.input_layernorm.weight", "{layer}/pre_self_attention_norm/scale", PlusOne()),
    # Hugging Face's post_attention_layernorm is the norm before the MLP.
    Rule("model.layers.{layer}.post_attention_layernorm.weight", "{layer}/pre_ffw_norm/scale", PlusOne()),
    *_ATTENTION_RULES,
    *llama.GATED_MLP_RULES,
)
# Gemma 2's block: its sub-layers in depth order, each module name suffixed by one (`self_attention_local`).
GEMMA2_SUBLAYERS = ("local", "global")
LOCAL = "local"  # the sliding-window one
# `{layer}/x` is x in a sub-layer of a block here (`decoder/layers_0/self_attention_local/...` for
# `self_attention/...`, `canonical.sublayer_path`): Hugging Face's layers 2i (local) and 2i + 1 (global).
GEMMA2_RULES = (
    *_COMMON_RULES,
    Rule("model.layers.{layer}.input_layernorm.weight", "{layer}/pre_self_attention_norm/scale", PlusOne()),
    Rule("model.layers.{layer}.post_attention_layernorm.weight", "{layer}/post_self_attention_norm/scale", PlusOne()),
    Rule("model.layers.{layer}.pre_feedforward_layernorm.weight", "{layer}/pre_ffw_norm/scale", PlusOne()),
    Rule("model.layers.{layer}.post_feedforward_layernorm.weight", "{layer}/post_ffw_norm/scale", PlusOne()),
    *_ATTENTION_RULES,
    *llama.GATED_MLP_RULES,
)

# transformers' class defaults of what each model reads (tests compare them with transformers').
_GEMMA_DEFAULTS = {
    "vocab_size": 256000,
    "hidden_size": 3072,
    "intermediate_size": 24576,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": None,
    "attention_bias": False,
    "use_bidirectional_attention": None,
}
GEMMA_CONFIG = ConfigClass("GemmaConfig", {**_GEMMA_DEFAULTS, "hidden_act": "gelu_pytorch_tanh"})
GEMMA2_CONFIG = ConfigClass(
    "Gemma2Config",
    {
        **_GEMMA_DEFAULTS,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "layer_types": None,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
)


def read_common(hf: Mapping[str, Any], decoder_block: str, activation: str) -> dict[str, Any]:
  require_one_of(hf, activation, TANH_GELUS)
  require(hf, "attention_bias", False, False)
  # transformers' Gemma attends both ways when this is set (an encoder): not a causal LM.
  require(hf, "use_bidirectional_attention", False, False)
  heads = get_int(hf, "num_attention_heads")
  return {
      "decoder_block": decoder_block,
      "base_emb_dim": get_int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
      "head_dim": head_dim(hf, "hidden_size", "num_attention_heads"),
      "base_mlp_dim": get_int(hf, "intermediate_size"),
      "vocab_size": get_int(hf, "vocab_size"),
      "normalization_layer_epsilon": get_float(hf, "rms_norm_eps"),
      **rope_from_hf(hf, llama3=False, default_theta=10000.0),
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
  }


def _gemma_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = GEMMA_CONFIG.read(raw)
  return {**read_common(hf, "gemma", "hidden_act"), "base_num_decoder_layers": get_int(hf, "num_hidden_layers")}


def soft_cap(hf: Mapping[str, Any], key: str) -> float:
  # null (or 0, which transformers' `is not None` would divide by) turns it off.
  value = get_float(hf, key, 0.0)
  if value < 0:
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be a positive number or null")
  return value


def _gemma2_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = GEMMA2_CONFIG.read(raw)
  layers = get_int(hf, "num_hidden_layers")
  kinds = hf["layer_types"]
  if kinds is None:  # Gemma2Config's __post_init__: sliding first, then alternating
    kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
  expected = ["sliding_attention", "full_attention"] * (layers // 2)
  if layers % 2 or kinds != expected:
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} with layer_types={kinds!r} is not supported; maxbridge's gemma2 "
        "stacks blocks of a sliding_attention then a full_attention layer (an even number of layers)"
    )
  window = get(hf, "sliding_window", None)
  if window is None:
    raise HFError(f"{CONFIG_FILE}: sliding_window=null gives sliding_attention layers no window; maxbridge needs one")
  window = get_int(hf, "sliding_window")
  if window <= 0:
    raise HFError(f"{CONFIG_FILE}: sliding_window={window} must be a positive integer")
  scalar = get_int(hf, "query_pre_attn_scalar")
  if scalar <= 0:
    raise HFError(f"{CONFIG_FILE}: query_pre_attn_scalar={scalar!r} must be > 0")
  return {
      **read_common(hf, "gemma2", "hidden_activation"),
      "base_num_decoder_layers": layers // 2,
      "sliding_window_size": window,
      "attn_logits_soft_cap": soft_cap(hf, "attn_logit_softcapping"),
      "final_logits_soft_cap": soft_cap(hf, "final_logit_softcapping"),
      "query_pre_attn_scalar": scalar,
  }


def gemma_common_to_hf(config: Config, layers: int) -> dict[str, Any]:
  return {
      **common_to_hf(config, layers),
      "attention_bias": False,
      "use_bidirectional_attention": None,
      **rope_to_hf(config),
  }


def _gemma_to_hf(config: Config) -> dict[str, Any]:
  return {**gemma_common_to_hf(config, config.num_decoder_layers), "hidden_act": "gelu_pytorch_tanh"}


def _gemma2_to_hf(config: Config) -> dict[str, Any]:
  layers = 2 * config.num_decoder_layers
  return {
      **gemma_common_to_hf(config, layers),
      "hidden_activation": "gelu_pytorch_tanh",
      "sliding_window": config.sliding_window_size,
      "layer_types": ["sliding_attention", "full_attention"] * config.num_decoder_layers,
      "query_pre_attn_scalar": query_pre_attn_scalar(config),
      "attn_logit_softcapping": config.attn_logits_soft_cap or None,
      "final_logit_softcapping": config.final_logits_soft_cap or None,
  }


def _no_qk_norm(config: Config) -> str | None:
  if config.use_qk_norm:
    return f"decoder_block={config.decoder_block!r} has no query/key norms: set use_qk_norm=false"
  return None


def _gemma_check(config: Config) -> list[str]:
  window = None
  if config.sliding_window_size or config.attn_logits_soft_cap or config.query_pre_attn_scalar:
    window = (
        "decoder_block='gemma' attends in full with Gemma 1's attention: sliding_window_size, attn_logits_soft_cap "
        "and query_pre_attn_scalar are Gemma 2's (decoder_block='gemma2'); leave them at 0"
    )
  return broken(_no_qk_norm(config), window)


def _gemma2_check(config: Config) -> list[str]:
  window = clip = None
  if not config.sliding_window_size:
    window = "decoder_block='gemma2' alternates sliding-window and global layers: set sliding_window_size > 0"
  if config.use_qk_clip and not config.attn_logits_soft_cap:  # with a soft-cap, the config's shared rule refuses it
    clip = (
        "use_qk_clip=true with decoder_block='gemma2': Gemma 2 bounds its attention logits by attn_logits_soft_cap, "
        "and QK-Clip is not implemented for its blocks of two attention layers; set use_qk_clip=false"
    )
  return broken(_no_qk_norm(config), window, clip)


# MaxText's model yml keys for what every Gemma computes: GeGLU (its "gelu" is tanh-approximated,
# as Flax's nn.gelu), and from Gemma 2 on, the norms after attention and after the MLP.
MAXTEXT_GEGLU = {"mlp_activations": ["gelu", "linear"]}
MAXTEXT_GEMMA2 = {**MAXTEXT_GEGLU, "use_post_attn_norm": True, "use_post_ffw_norm": True}


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """Soft-capped logits, the query scaled by query_pre_attn_scalar; a `local` layer has the window and its RoPE."""
  del kv_shared
  return dataclasses.replace(
      attn.standard(config),
      sliding_window_size=config.sliding_window_size if local else 0,
      rope=attn.LOCAL_ROPE if local else attn.ROPE,
      query_scale=attn.run_time_scale(config, query_pre_attn_scalar(config)),
      logits_soft_cap=config.attn_logits_soft_cap,
  )


GEMMA = Family(
    decoder_blocks=("gemma",),
    stacks=(Stack("layers", "gemma"),),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=True,
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,
    hf=(
        HFFamily(
            "gemma",
            "GemmaForCausalLM",
            ("gemma",),
            GEMMA_RULES,
            _gemma_from_hf,
            _gemma_to_hf,
            GEMMA_CONFIG,
            normalize_embedding_logits=True,
        ),
    ),
    check=_gemma_check,
    maxtext_fixed=MAXTEXT_GEGLU,
)

GEMMA2 = Family(
    decoder_blocks=("gemma2",),
    stacks=(Stack("layers", "gemma2", sublayers=GEMMA2_SUBLAYERS, suffixed=True),),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=True,
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,  # unused: gemma2 refuses QK-Clip (`_gemma2_check`)
    hf=(
        HFFamily(
            "gemma2",
            "Gemma2ForCausalLM",
            ("gemma2",),
            GEMMA2_RULES,
            _gemma2_from_hf,
            _gemma2_to_hf,
            GEMMA2_CONFIG,
            normalize_embedding_logits=True,
        ),
    ),
    check=_gemma2_check,
    ring_cache=False,
    maxtext_fixed=MAXTEXT_GEMMA2,
)
