"""gpt-oss: attention with biases and per-head sinks, alternating windows, YaRN RoPE, and biased clamped-SwiGLU experts.

A layer is Llama's (pre-norms, residuals) with its own parts: q/k/v/o
projections with biases, a learned sink logit per query head that joins each
softmax (`self_attention/sinks`), and routed experts (`MoeBlock_0`) whose
router has a bias and whose experts hold one fused input kernel `wi`
[E, D, 2F] (gate and up interleaved, as Hugging Face stores `gate_up_proj`)
with biases, activated by `ops.mlp.clamped_swiglu`.

Layers alternate a sliding window and full attention. As MaxText's
GptOssScannableBlock, the decoder stacks blocks of the two (`SUBLAYERS`) and
scans them: `base_num_decoder_layers` counts layers (MaxText's, an even
number), the stack holds half as many blocks. Every layer caches every token
while decoding (`ring_cache=False`): the windowed ones mask by position.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from maxbridge.core.families import attention as attn
from maxbridge.core.families.base import (
    Config,
    Family,
    Stack,
    broken,
    key_value_cache,
    query_kernel_clip,
    routes_to_experts,
)
from maxbridge.core.families.hf_rules import (
    common_to_hf,
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Reshape,
    Rule,
    get,
    get_bool,
    get_float,
    get_int,
    head_dim,
    require,
    rope_parameters,
)

SUBLAYERS = ("local", "global")  # a block's layers, in depth order: sliding window, then full
GLOBAL = "global"
_KINDS = ["sliding_attention", "full_attention"]  # Hugging Face's layer_types of one block
# The sigmoid gain of the experts' SwiGLU; transformers' swiglu_alpha, which MaxText fixes too.
SWIGLU_ALPHA = 1.702

_ATTENTION = "model.layers.{layer}.self_attn"
_MOE = "{layer}/MoeBlock_0"
RULES = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding"),
    Rule("model.norm.weight", "decoder/decoder_norm/scale"),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
    Rule("model.layers.{layer}.input_layernorm.weight", "{layer}/pre_self_attention_layer_norm/scale"),
    Rule("model.layers.{layer}.post_attention_layernorm.weight", "{layer}/post_self_attention_layer_norm/scale"),
    # The query kernel does not carry 1/sqrt(head_dim): its bias would have to as well, so attention scales.
    Rule(f"{_ATTENTION}.q_proj.weight", "{layer}/self_attention/query/kernel", Linear()),
    Rule(f"{_ATTENTION}.k_proj.weight", "{layer}/self_attention/key/kernel", Linear()),
    Rule(f"{_ATTENTION}.v_proj.weight", "{layer}/self_attention/value/kernel", Linear()),
    Rule(f"{_ATTENTION}.o_proj.weight", "{layer}/self_attention/out/kernel", Linear(in_ndim=2)),
    Rule(f"{_ATTENTION}.q_proj.bias", "{layer}/self_attention/query/bias", Reshape()),
    Rule(f"{_ATTENTION}.k_proj.bias", "{layer}/self_attention/key/bias", Reshape()),
    Rule(f"{_ATTENTION}.v_proj.bias", "{layer}/self_attention/value/bias", Reshape()),
    Rule(f"{_ATTENTION}.o_proj.bias", "{layer}/self_attention/out/bias"),
    Rule(f"{_ATTENTION}.sinks", "{layer}/self_attention/sinks"),
    Rule("model.layers.{layer}.mlp.router.weight", f"{_MOE}/gate/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.router.bias", f"{_MOE}/gate/bias"),
    # Stacked over experts and laid out [in, out] already, on both sides.
    Rule("model.layers.{layer}.mlp.experts.gate_up_proj", f"{_MOE}/wi"),
    Rule("model.layers.{layer}.mlp.experts.gate_up_proj_bias", f"{_MOE}/wi_bias"),
    Rule("model.layers.{layer}.mlp.experts.down_proj", f"{_MOE}/wo"),
    Rule("model.layers.{layer}.mlp.experts.down_proj_bias", f"{_MOE}/wo_bias"),
)

# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "GptOssConfig",
    {
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "sliding_window": 128,
        "layer_types": None,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "attention_bias": True,
    },
    aliases={"num_experts": "num_local_experts"},
    default_theta=150000.0,
)
# GptOssConfig's __post_init__ when config.json gives no RoPE.
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _rope_from_hf(raw: Mapping[str, Any], hf: Mapping[str, Any]) -> dict[str, Any]:
  """Our RoPE keys, read as transformers' `_compute_yarn_parameters` (or default RoPE) reads them."""
  if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
    raw = {**raw, "rope_parameters": _DEFAULT_ROPE}
  parameters, source = rope_parameters({**raw, "max_position_embeddings": hf["max_position_embeddings"]}, 150000.0)
  rope_type = parameters["rope_type"]
  if rope_type not in ("default", "yarn"):
    raise HFError(
        f"{CONFIG_FILE}: {source}.rope_type={rope_type!r} is not supported; maxbridge's gpt_oss implements "
        "'yarn' and 'default'"
    )
  fraction = parameters.get("partial_rotary_factor", 1.0)
  if fraction != 1.0:
    raise HFError(f"{CONFIG_FILE}: partial_rotary_factor={fraction!r} is not supported; maxbridge rotates whole heads")
  theta = parameters["rope_theta"]
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta != int(theta):
    raise HFError(f"{CONFIG_FILE}: {source}.rope_theta={theta!r} must be a whole number (rope_max_timescale)")
  values: dict[str, Any] = {"rope_max_timescale": int(theta), "rope_type": rope_type}
  if rope_type == "default":
    return values
  for key in ("attention_factor", "mscale", "mscale_all_dim"):
    if parameters.get(key) is not None:
      raise HFError(
          f"{CONFIG_FILE}: {source}.{key}={parameters[key]!r} is not supported; maxbridge's YaRN scales attention "
          "by transformers' default 0.1 * ln(factor) + 1"
      )
  original = get_int(parameters, "original_max_position_embeddings")
  # transformers: a missing factor is the ratio of the two context lengths.
  factor = get_float(parameters, "factor", hf["max_position_embeddings"] / original)
  truncate = parameters.get("truncate", True)
  if not isinstance(truncate, bool):
    raise HFError(f"{CONFIG_FILE}: {source}.truncate={truncate!r} must be true or false")
  return {
      **values,
      "rope_factor": factor,
      # transformers' `or`: a 0 or null reads as the default.
      "beta_fast": float(parameters.get("beta_fast") or 32),
      "beta_slow": float(parameters.get("beta_slow") or 1),
      "rope_truncate": truncate,
      "original_max_position_embeddings": original,
  }


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  # transformers builds q/k/v/o biases from attention_bias; maxbridge's gpt_oss always has them.
  require(hf, "attention_bias", True, True)
  layers = get_int(hf, "num_hidden_layers")
  kinds = hf["layer_types"]
  if kinds is None:  # GptOssConfig's __post_init__: sliding first, then alternating
    kinds = [_KINDS[i % 2] for i in range(layers)]
  if layers % 2 or kinds != _KINDS * (layers // 2):
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} with layer_types={kinds!r} is not supported; maxbridge's gpt_oss "
        "stacks blocks of a sliding_attention then a full_attention layer (an even number of layers)"
    )
  window = get(hf, "sliding_window", None)
  if window is None or get_int(hf, "sliding_window") <= 0:
    raise HFError(f"{CONFIG_FILE}: sliding_window={window!r} must be a positive integer")
  alpha = get_float(hf, "swiglu_alpha")
  if alpha != SWIGLU_ALPHA:
    raise HFError(f"{CONFIG_FILE}: swiglu_alpha={alpha!r} is not supported; maxbridge's gpt_oss uses {SWIGLU_ALPHA}")
  limit = get_float(hf, "swiglu_limit")
  if not 0 < limit < math.inf:
    raise HFError(f"{CONFIG_FILE}: swiglu_limit={limit!r} must be a positive number")
  heads = get_int(hf, "num_attention_heads")
  # transformers adds the router's auxiliary loss only where output_router_logits asks for router logits.
  aux = get_float(hf, "router_aux_loss_coef") if get_bool(hf, "output_router_logits") else 0.0
  return {
      "decoder_block": "gpt_oss",
      "base_emb_dim": get_int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
      "head_dim": head_dim(hf, "hidden_size", "num_attention_heads"),
      "base_mlp_dim": get_int(hf, "intermediate_size"),
      "base_num_decoder_layers": layers,
      "vocab_size": get_int(hf, "vocab_size"),
      "normalization_layer_epsilon": get_float(hf, "rms_norm_eps"),
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
      "sliding_window_size": window,
      "num_experts": get_int(hf, "num_local_experts"),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "mlp_activations_limit": limit,
      "load_balance_loss_weight": aux,
      **_rope_from_hf(raw, hf),
  }


def _rope_to_hf(config: Config) -> dict[str, Any]:
  theta = float(config.rope_max_timescale)
  parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
  if config.rope_type == "yarn":
    parameters.update(
        rope_type="yarn",
        factor=config.rope_factor,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
        truncate=config.rope_truncate,
        original_max_position_embeddings=config.original_max_position_embeddings,
    )
  return {"rope_parameters": parameters, "rope_scaling": None, "rope_theta": theta}


def _config_to_hf(config: Config) -> dict[str, Any]:
  if not config.mlp_activations_limit:
    raise HFError("mlp_activations_limit=0 (no clamp) has no Hugging Face gpt_oss equivalent: set swiglu's limit > 0")
  hf = {
      **common_to_hf(config),
      "hidden_act": "silu",
      "attention_bias": True,
      "sliding_window": config.sliding_window_size,
      "layer_types": _KINDS * (config.num_decoder_layers // 2),
      "num_local_experts": config.num_experts,
      "num_experts_per_tok": config.num_experts_per_tok,
      "swiglu_alpha": SWIGLU_ALPHA,
      "swiglu_limit": config.mlp_activations_limit,
      "output_router_logits": config.load_balance_loss_weight > 0,
      **_rope_to_hf(config),
  }
  if config.load_balance_loss_weight > 0:  # else an imported config's coefficient is kept, and unused
    hf["router_aux_loss_coef"] = config.load_balance_loss_weight
  return hf


def _check(config: Config) -> list[str]:
  window = layers = attention = routing = rope = clip = None
  if not config.sliding_window_size:
    window = "decoder_block='gpt_oss' alternates sliding-window and full layers: set sliding_window_size > 0"
  if config.num_decoder_layers % len(SUBLAYERS):
    layers = (
        f"decoder_block='gpt_oss' stacks blocks of {len(SUBLAYERS)} layers: base_num_decoder_layers="
        f"{config.num_decoder_layers} must be even"
    )
  if config.use_qk_norm or config.attn_logits_soft_cap:
    attention = (
        "decoder_block='gpt_oss' has neither query/key norms nor an attention soft-cap: set use_qk_norm=false "
        "and attn_logits_soft_cap=0"
    )
  if config.routed_score_func or config.routed_scaling_factor != 1.0:
    routing = (
        "decoder_block='gpt_oss' routes by a softmax over the top-k (biased) router logits: set "
        "routed_score_func='' and routed_scaling_factor=1"
    )
  if config.rope_type not in ("default", "yarn"):
    rope = (
        f"decoder_block='gpt_oss' rotates with YaRN or plain RoPE: rope_type={config.rope_type!r} must be yarn or default"
    )
  if config.use_qk_clip:
    clip = (
        "use_qk_clip=true with decoder_block='gpt_oss': QK-Clip is not implemented for its blocks of two attention "
        "layers, whose query biases and sinks a kernel rescale would not bound; set use_qk_clip=false"
    )
  return broken(routes_to_experts(config), window, layers, attention, routing, rope, clip)


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """Biased projections and a sink logit per query head; a `local` layer has the sliding window."""
  del kv_shared
  return attn.AttentionSpec(
      head_dim=config.head_dim,
      kv_heads=config.num_kv_heads,
      qkv_bias=True,
      out_bias=True,
      sinks=True,
      sliding_window_size=config.sliding_window_size if local else 0,
      ring_cache=attn.ring_cache(config),
      query_scale=config.head_dim**-0.5,
  )


FAMILY = Family(
    decoder_blocks=("gpt_oss",),
    stacks=(Stack("layers", "gpt_oss", depth=lambda config: config.num_decoder_layers // 2, sublayers=SUBLAYERS),),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # the query bias would need the factor too; attention scales at run time
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,  # unused: gpt_oss refuses QK-Clip (`_check`)
    hf=(HFFamily("gpt_oss", "GptOssForCausalLM", ("gpt_oss",), RULES, _config_from_hf, _config_to_hf, CONFIG_CLASS),),
    check=_check,
    ring_cache=False,
    maxtext_fixed={"attention_bias": True},  # MaxText's gpt-oss files set it: its q/k/v/o biases
)
