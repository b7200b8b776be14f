"""DeepSeek's Hugging Face folders: V2's, V3's (and Kimi-K2's), and V3.2's tensors and config.json, both ways.

The family itself (its checks, caches and stacks) is `deepseek`; GLM-4.5 reads its MoE fields with
`moe_from_hf` / `moe_to_hf`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from maxbridge.core.families import llama
from maxbridge.core.families.attention import yarn_mscale
from maxbridge.core.families.base import (
    Config,
)
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    common_to_hf,
    ConfigClass,
    HFError,
    Linear,
    Rule,
    SwappedHalves,
    get_bool,
    get_float,
    get_int,
    query_scale,
    require,
    require_one_of,
    rope_from_hf,
    rope_parameters,
    rope_to_hf,
)

_MLA = "{layer}/self_attention"
_MOE = "{layer}/DeepSeekMoeBlock_0"
RULES = (
    llama.COMMON_RULES
    + llama.GATED_MLP_RULES
    + (
        Rule("model.layers.{layer}.self_attn.q_proj.weight", f"{_MLA}/query/kernel", Linear(scale=query_scale)),
        Rule("model.layers.{layer}.self_attn.q_a_proj.weight", f"{_MLA}/wq_a/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.q_a_layernorm.weight", f"{_MLA}/q_norm/scale"),
        Rule("model.layers.{layer}.self_attn.q_b_proj.weight", f"{_MLA}/wq_b/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", f"{_MLA}/wkv_a/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.kv_a_layernorm.weight", f"{_MLA}/kv_norm/scale"),
        Rule("model.layers.{layer}.self_attn.kv_b_proj.weight", f"{_MLA}/wkv_b/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.o_proj.weight", f"{_MLA}/out/kernel", Linear(in_ndim=2)),
        # MoE layers (the dense ones use llama's gated MLP rules, `mlp`).
        Rule("model.layers.{layer}.mlp.gate.weight", f"{_MOE}/MoeBlock_0/gate/kernel", Linear()),
        Rule("model.layers.{layer}.mlp.gate.e_score_correction_bias", f"{_MOE}/MoeBlock_0/gate/bias"),
        Rule("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", f"{_MOE}/MoeBlock_0/wi_0", Linear()),
        Rule("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", f"{_MOE}/MoeBlock_0/wi_1", Linear()),
        Rule("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", f"{_MOE}/MoeBlock_0/wo", Linear()),
        Rule("model.layers.{layer}.mlp.shared_experts.gate_proj.weight", f"{_MOE}/shared_experts/wi_0/kernel", Linear()),
        Rule("model.layers.{layer}.mlp.shared_experts.up_proj.weight", f"{_MOE}/shared_experts/wi_1/kernel", Linear()),
        Rule("model.layers.{layer}.mlp.shared_experts.down_proj.weight", f"{_MOE}/shared_experts/wo/kernel", Linear()),
        # Multi-token prediction modules (mtp_num_layers), stored after the decoder layers.
        Rule("model.layers.{layer}.enorm.weight", "{mtp}/embedding_norm/scale"),
        Rule("model.layers.{layer}.hnorm.weight", "{mtp}/hidden_norm/scale"),
        Rule("model.layers.{layer}.eh_proj.weight", "{mtp}/projection/kernel", SwappedHalves()),
        # The module's own final norm before the shared head (DeepSeek-V3's checkpoints hold one of other values
        # than model.norm).
        Rule("model.layers.{layer}.shared_head.norm.weight", "{mtp}/head_norm/scale"),
    )
)
_INDEXER = f"{_MLA}/indexer"
# DeepSeek-V3.2: V3's tensors and each layer's indexer (transformers' DeepseekV32Indexer, named alike).
V32_RULES = RULES + (
    Rule("model.layers.{layer}.self_attn.indexer.wq_b.weight", f"{_INDEXER}/wq_b/kernel", Linear()),
    Rule("model.layers.{layer}.self_attn.indexer.wk.weight", f"{_INDEXER}/wk/kernel", Linear()),
    Rule("model.layers.{layer}.self_attn.indexer.k_norm.weight", f"{_INDEXER}/k_norm/scale"),
    Rule("model.layers.{layer}.self_attn.indexer.k_norm.bias", f"{_INDEXER}/k_norm/bias"),
    Rule("model.layers.{layer}.self_attn.indexer.weights_proj.weight", f"{_INDEXER}/weights_proj/kernel", Linear()),
)
# An MTP layer's own copies of the shared embedding and output head (ours share the model's; DeepSeek-V3's
# README_WEIGHTS says both are shared with the main model, and import checks they are equal).
MTP_COPIES = {
    "model.layers.{layer}.embed_tokens.weight": "token_embedder/embedding",
    "model.layers.{layer}.shared_head.head.weight": "decoder/logits_dense/kernel",
}


# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "DeepseekV3Config",
    {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "rope_interleave": True,
        "attention_bias": False,
    },
    aliases={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
)


def _rope_from_hf(hf: Mapping[str, Any], default_theta: float = CONFIG_CLASS.default_theta) -> dict[str, Any]:
  """Our RoPE keys: default RoPE, or YaRN as transformers' DeepseekV3 reads it (`_compute_yarn_parameters` for the
  frequencies and the cos/sin factor, `yarn_apply_mscale` for the softmax scale)."""
  parameters, source = rope_parameters(hf, default_theta)
  if parameters["rope_type"] != "yarn":
    return rope_from_hf(hf, llama3=False, default_theta=default_theta)
  values = rope_from_hf({**hf, source: {**parameters, "rope_type": "default"}}, llama3=False, default_theta=0)
  given = hf.get(source) or {}
  # transformers fills these in from max_position_embeddings; DeepSeek-V3's and Kimi-K2's config.json give both.
  for key in ("factor", "original_max_position_embeddings"):
    if given.get(key) is None:
      raise HFError(f"{CONFIG_FILE}: {source} of rope_type 'yarn' has no {key!r}, which maxbridge needs")
  factor = get_float(given, "factor")
  truncate = parameters.get("truncate", True)
  if not isinstance(truncate, bool):
    raise HFError(f"{CONFIG_FILE}: {source}.truncate={truncate!r} must be true or false")
  # transformers' `or` and truthiness: a 0 or null reads as its default.
  mscale = get_float(parameters, "mscale", 0.0)
  all_dim = get_float(parameters, "mscale_all_dim", 0.0)
  if parameters.get("attention_factor") is not None:
    attention_factor = get_float(parameters, "attention_factor")
  elif mscale and all_dim:
    attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
  else:
    attention_factor = yarn_mscale(factor, 1.0)
  # MaxText's rope_attention_scaling: the rotated parts times 1 (false) or yarn's 0.1 ln(factor) + 1 (true).
  scaled = not math.isclose(attention_factor, 1.0, rel_tol=1e-12)
  if scaled and not math.isclose(attention_factor, yarn_mscale(factor, 1.0), rel_tol=1e-12):
    raise HFError(
        f"{CONFIG_FILE}: {source} scales YaRN's cos/sin by {attention_factor!r} (attention_factor, or mscale over "
        f"mscale_all_dim); maxbridge's MLA scales them by 1 or by 0.1 * ln(factor) + 1 = {yarn_mscale(factor, 1.0)!r}"
    )
  return {
      **values,
      "rope_type": "yarn",
      "rope_factor": factor,
      "beta_fast": float(parameters.get("beta_fast") or 32),
      "beta_slow": float(parameters.get("beta_slow") or 1),
      "rope_truncate": truncate,
      "original_max_position_embeddings": get_int(given, "original_max_position_embeddings"),
      "rope_attention_scaling": scaled,
      "mscale": all_dim,
  }


def _rope_to_hf(config: Config) -> dict[str, Any]:
  if config.rope_type != "yarn":
    return rope_to_hf(config)
  theta = float(config.rope_max_timescale)
  parameters: dict[str, Any] = {
      "rope_type": "yarn",
      "rope_theta": theta,
      "factor": config.rope_factor,
      "original_max_position_embeddings": config.original_max_position_embeddings,
      "beta_fast": config.beta_fast,
      "beta_slow": config.beta_slow,
      "truncate": config.rope_truncate,
      # The softmax scale's mscale; the cos/sin factor is mscale / mscale_all_dim where both are given, else
      # 0.1 ln(factor) + 1 (or attention_factor where given).
      "mscale_all_dim": config.mscale,
  }
  if not config.rope_attention_scaling:
    parameters.update({"mscale": config.mscale} if config.mscale else {"attention_factor": 1.0})
  # DeepSeek's own config.json spells it rope_scaling, which transformers 4 reads (5 reads either).
  return {"rope_parameters": parameters, "rope_scaling": dict(parameters), "rope_theta": theta}


def v3_config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  require_one_of(hf, "hidden_act", ("silu", "swish"))
  require(hf, "attention_bias", False, False)
  require(hf, "rope_interleave", True, True)
  require(hf, "norm_topk_prob", True, True)
  # Not DeepseekV3Config fields (its model always scores by sigmoid with a correction bias), but
  # DeepSeek's own config.json spells them out: another value describes another model.
  require(hf, "scoring_func", "sigmoid", "sigmoid")
  require(hf, "topk_method", "noaux_tc", "noaux_tc")
  return {
      **_mla_from_hf(hf),
      **_rope_from_hf(hf),
      **moe_from_hf(hf),
      "n_routing_groups": get_int(hf, "n_group"),
      "topk_routing_group": get_int(hf, "topk_group"),
      "routed_score_func": "sigmoid",
      "routed_bias": True,
  }


# transformers' DeepseekV32Config: V3's fields (its max_position_embeddings and n_group defaults its own), no
# rope_interleave (its MLA always interleaves, its indexer never) and the indexer's three.
V32_CONFIG_CLASS = ConfigClass(
    "DeepseekV32Config",
    {
        **{key: value for key, value in CONFIG_CLASS.defaults.items() if key != "rope_interleave"},
        "max_position_embeddings": 163840,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "mlp_layer_types": None,
    },
    aliases={"num_local_experts": "n_routed_experts"},
)


def _v32_dense_layers(hf: Mapping[str, Any]) -> int:
  """The leading dense layers: mlp_layer_types' where given (transformers' model reads it, not
  first_k_dense_replace, which only fills it in), as long as it is dense layers, then MoE ones."""
  layers = get_int(hf, "num_hidden_layers")
  if hf.get("mlp_layer_types") is None:
    return min(get_int(hf, "first_k_dense_replace"), layers)
  kinds = list(hf["mlp_layer_types"])
  dense = kinds.count("dense")
  if kinds != ["dense"] * dense + ["sparse"] * (layers - dense):
    raise HFError(
        f"{CONFIG_FILE}: mlp_layer_types={kinds!r}: maxbridge's DeepSeek layers are num_hidden_layers={layers} "
        "of 'dense' layers, then 'sparse' (MoE) ones"
    )
  return dense


def v32_config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = V32_CONFIG_CLASS.read(raw)
  # Its attention always has the low-rank query, which the indexer reads too.
  if hf.get("q_lora_rank") is None:
    raise HFError(f"{CONFIG_FILE}: q_lora_rank=None: DeepSeek-V3.2's attention needs a low-rank query (an integer)")
  hf = {**hf, "first_k_dense_replace": _v32_dense_layers(hf)}
  return {
      **v3_config_from_hf({**hf, "rope_interleave": True}),
      "use_indexer": True,
      "indexer_topk": get_int(hf, "index_topk"),
      "indexer_n_heads": get_int(hf, "index_n_heads"),
      "indexer_head_dim": get_int(hf, "index_head_dim"),
  }


def v32_config_to_hf(config: Config) -> dict[str, Any]:
  written = v3_config_to_hf(config)
  del written["rope_interleave"]
  return {
      **written,
      "index_topk": config.indexer_topk,
      "index_n_heads": config.indexer_n_heads,
      "index_head_dim": config.indexer_head_dim,
      "mlp_layer_types": None,  # transformers fills it in from first_k_dense_replace
  }


def _mla_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """DeepSeek V2's and V3's sizes and MLA's (a head is its no-RoPE and RoPE parts)."""
  heads = get_int(hf, "num_attention_heads")
  nope, rope = get_int(hf, "qk_nope_head_dim"), get_int(hf, "qk_rope_head_dim")
  return {
      "decoder_block": "deepseek",
      "base_emb_dim": get_int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
      "head_dim": nope + rope,
      "base_mlp_dim": get_int(hf, "intermediate_size"),
      "base_num_decoder_layers": get_int(hf, "num_hidden_layers"),
      "vocab_size": get_int(hf, "vocab_size"),
      "normalization_layer_epsilon": get_float(hf, "rms_norm_eps"),
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
      "q_lora_rank": get_int(hf, "q_lora_rank", 0),
      "kv_lora_rank": get_int(hf, "kv_lora_rank"),
      "qk_nope_head_dim": nope,
      "qk_rope_head_dim": rope,
      "v_head_dim": get_int(hf, "v_head_dim"),
  }


def _mla_to_hf(config: Config) -> dict[str, Any]:
  return {
      **common_to_hf(config),
      "q_lora_rank": config.q_lora_rank or None,
      "kv_lora_rank": config.kv_lora_rank,
      "qk_nope_head_dim": config.qk_nope_head_dim,
      "qk_rope_head_dim": config.qk_rope_head_dim,
      "head_dim": config.qk_rope_head_dim,  # what transformers sizes its rotary tables by
      "v_head_dim": config.v_head_dim,
      "hidden_act": "silu",
      "attention_bias": False,
      **_rope_to_hf(config),
  }


def moe_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The fields of DeepSeek's MoE (dense layers first, then routed and shared experts) that every config class
  built on it (DeepSeek V2 and V3, GLM-4.5) spells alike; its routing is each family's own."""
  return {
      "moe_mlp_dim": get_int(hf, "moe_intermediate_size"),
      "first_num_dense_layers": get_int(hf, "first_k_dense_replace"),
      "num_experts": get_int(hf, "n_routed_experts"),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "shared_experts": get_int(hf, "n_shared_experts"),
      "routed_scaling_factor": get_float(hf, "routed_scaling_factor"),
      "load_balance_loss_weight": 0.0,  # their models add none
  }


def moe_to_hf(config: Config) -> dict[str, Any]:
  """`moe_from_hf`'s fields written back."""
  return {
      "moe_intermediate_size": config.moe_mlp_dim,
      "first_k_dense_replace": config.first_num_dense_layers,
      "n_routed_experts": config.num_experts,
      "num_experts_per_tok": config.num_experts_per_tok,
      "n_shared_experts": config.shared_experts,
      "routed_scaling_factor": config.routed_scaling_factor,
  }


# DeepSeek-V2: no router correction bias (`gate.e_score_correction_bias`), no multi-token prediction.
V2_RULES = tuple(rule for rule in RULES if not rule.ours.startswith("{mtp}") and "e_score_correction" not in rule.hf)
V2_CONFIG_CLASS = ConfigClass(
    "DeepseekV2Config",
    {
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "moe_intermediate_size": 1407,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": None,
        "topk_group": None,
        "topk_method": "greedy",
        "num_experts_per_tok": None,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "attention_bias": False,
        "mlp_bias": False,
    },
    aliases={"num_experts": "n_routed_experts"},
)
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def v2_config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = V2_CONFIG_CLASS.read(raw)
  require_one_of(hf, "hidden_act", ("silu", "swish"))
  require(hf, "attention_bias", False, False)
  require(hf, "mlp_bias", False, False)
  # transformers' DeepseekV2 never reads norm_topk_prob (DeepSeek's own code renormalises where it is true):
  # true names a model the two compute differently.
  require(hf, "norm_topk_prob", False, False)
  # Not DeepseekV2Config fields, but DeepSeek's own config.json spells them out: another value, another model.
  require(hf, "scoring_func", "softmax", "softmax")
  require(hf, "moe_layer_freq", 1, 1)
  require_one_of(hf, "topk_method", _V2_TOPK_METHODS)
  grouped = hf["topk_method"] == "group_limited_greedy"
  return {
      **_mla_from_hf(hf),
      **_rope_from_hf(hf, V2_CONFIG_CLASS.default_theta),
      **moe_from_hf(hf),
      # greedy (V2-Lite, whose n_group and topk_group are 1) reads neither.
      "n_routing_groups": get_int(hf, "n_group") if grouped else -1,
      "topk_routing_group": get_int(hf, "topk_group") if grouped else -1,
      "routed_score_func": "softmax",
      "routed_bias": False,
      "norm_topk_prob": False,
  }


def v2_config_to_hf(config: Config) -> dict[str, Any]:
  if config.routed_bias or config.norm_topk_prob or config.mtp_num_layers:
    raise HFError(
        "DeepSeek-V2 routes by a softmax over its experts, its chosen weights not renormalised, and has no "
        f"multi-token prediction: routed_bias={config.routed_bias}, norm_topk_prob={config.norm_topk_prob} and "
        f"mtp_num_layers={config.mtp_num_layers} must be false, false and 0 for an export"
    )
  grouped = config.n_routing_groups > 0
  return {
      **_mla_to_hf(config),
      **moe_to_hf(config),
      "topk_method": "group_limited_greedy" if grouped else "greedy",
      "n_group": config.n_routing_groups if grouped else 1,
      "topk_group": config.topk_routing_group if grouped else 1,
      "norm_topk_prob": False,
      "scoring_func": "softmax",
      "mlp_bias": False,
  }


def v3_config_to_hf(config: Config) -> dict[str, Any]:
  if config.routed_score_func != "sigmoid" or not config.routed_bias:
    raise HFError(
        "DeepSeek-V3 routes by sigmoid scores with a correction bias: routed_score_func='sigmoid' "
        "and routed_bias=true are needed for an export"
    )
  return {
      **_mla_to_hf(config),
      **moe_to_hf(config),
      "n_group": max(config.n_routing_groups, 1),
      "topk_group": max(config.topk_routing_group, 1),
      "norm_topk_prob": True,
      "rope_interleave": True,
      "num_nextn_predict_layers": config.mtp_num_layers,
  }
