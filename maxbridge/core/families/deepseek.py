"""DeepSeek-V2 and V3: multi-head latent attention (MLA), dense layers then MoE layers with shared experts.

One decoder block ("deepseek", as MaxText's deepseek2-* and deepseek3-* files): what differs is data. V3 routes
by sigmoid scores with a correction bias (routed_score_func='sigmoid', routed_bias, groups ranked by their top
two), V2 by a softmax over the experts (routed_score_func='softmax', weights not renormalised, groups ranked by
their best expert: `ops.moe.group_limited_softmax`). Each imports from and exports to its own transformers class.
DeepSeek-V3.2 is V3 with a lightning indexer in each MLA layer (`use_indexer`, MaxText's keys `indexer_*`:
`ops.indexer`); Kimi-K2's folders (model_type kimi_k2) are DeepSeek-V3's architecture at other sizes, read as V3.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from maxbridge.core.families import llama
from maxbridge.core.families.attention import yarn_mscale
from maxbridge.core.families.base import (
    CacheEntries,
    ClipPiece,
    ClipTargets,
    Config,
    Family,
    Stack,
    broken,
    no_grouped_query_attention,
    own_attention,
    routes_to_experts,
)
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    common_to_hf,
    ConfigClass,
    HFError,
    HFFamily,
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


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
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


def _v32_config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = V32_CONFIG_CLASS.read(raw)
  # Its attention always has the low-rank query, which the indexer reads too.
  if hf.get("q_lora_rank") is None:
    raise HFError(f"{CONFIG_FILE}: q_lora_rank=None: DeepSeek-V3.2's attention needs a low-rank query (an integer)")
  hf = {**hf, "first_k_dense_replace": _v32_dense_layers(hf)}
  return {
      **_config_from_hf({**hf, "rope_interleave": True}),
      "use_indexer": True,
      "indexer_topk": get_int(hf, "index_topk"),
      "indexer_n_heads": get_int(hf, "index_n_heads"),
      "indexer_head_dim": get_int(hf, "index_head_dim"),
  }


def _v32_config_to_hf(config: Config) -> dict[str, Any]:
  written = _config_to_hf(config)
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


def _v2_config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
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


def _v2_config_to_hf(config: Config) -> dict[str, Any]:
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


def _config_to_hf(config: Config) -> dict[str, Any]:
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


def _latent_cache(config: Config) -> CacheEntries:
  # As DeepSeek does: the normed latent and the rotated shared rope key, expanded to keys and values on every read;
  # with the indexer, its rotated keys too.
  entries = {"cached_latent": (config.kv_lora_rank,), "cached_key_rope": (config.qk_rope_head_dim,)}
  if config.use_indexer:
    entries["cached_index_key"] = (config.indexer_head_dim,)
  return entries


def _qk_clip_targets(config: Config) -> ClipTargets:
  """MLA: the query's and the key's no-RoPE parts by √s each, the query's RoPE part by s (its key is shared)."""
  nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
  query = "self_attention/query/kernel" if config.q_lora_rank == 0 else "self_attention/wq_b/kernel"
  return {
      query: (1, (ClipPiece(2, 0, nope, 0.5), ClipPiece(2, nope, nope + rope, 1.0))),
      "self_attention/wkv_b/kernel": (1, (ClipPiece(2, 0, nope, 0.5),)),
  }


def _routing_groups(config: Config) -> str | None:
  groups, top_groups = config.n_routing_groups, config.topk_routing_group
  if (groups == -1) != (top_groups == -1):
    return f"n_routing_groups={groups} and topk_routing_group={top_groups}: set both, or both to -1"
  if groups == -1:
    return None
  if config.num_experts % groups or config.num_experts // groups < 2:
    return (
        f"n_routing_groups={groups} must split num_experts={config.num_experts} into equal "
        "groups of at least 2 experts (groups are ranked by their top-2 scores)"
    )
  if top_groups > groups:
    return f"topk_routing_group={top_groups} exceeds n_routing_groups={groups}"
  if config.num_experts_per_tok > top_groups * (config.num_experts // groups):
    return (
        f"num_experts_per_tok={config.num_experts_per_tok} exceeds the experts in "
        f"topk_routing_group={top_groups} groups of {config.num_experts // groups}"
    )
  return None


def _router_bias(config: Config) -> str | None:
  if config.routed_bias and config.routed_score_func != "sigmoid":
    return (
        f"routed_bias=true with routed_score_func={config.routed_score_func!r}: the correction bias is DeepSeek-V3's, "
        "which routes by sigmoid scores; set routed_score_func='sigmoid' or routed_bias=false (DeepSeek-V2)"
    )
  return None


def _mla_rope(config: Config) -> str | None:
  if config.rope_type not in ("default", "yarn"):
    return (
        f"rope_type={config.rope_type!r}: decoder_block='deepseek' turns MLA's rope parts by plain RoPE or YaRN: "
        "set rope_type='default' or 'yarn'"
    )
  return None


def _indexer(config: Config) -> str | None:
  if not config.use_indexer:
    return None
  for key in ("indexer_n_heads", "indexer_head_dim", "indexer_topk"):
    if getattr(config, key) < 1:
      return f"{key}={getattr(config, key)} must be a positive integer (use_indexer=true)"
  if config.q_lora_rank == 0:
    return "use_indexer=true needs q_lora_rank > 0: the indexer's queries come from MLA's low-rank query"
  if config.indexer_head_dim < config.qk_rope_head_dim:
    return (
        f"indexer_head_dim={config.indexer_head_dim} must be at least qk_rope_head_dim={config.qk_rope_head_dim}: "
        "the indexer turns its first qk_rope_head_dim dims by RoPE"
    )
  if config.attention == "flash":
    return (
        "attention='flash' with use_indexer=true: the indexer's choice of keys is a mask only the dot-product "
        "kernel reads; set attention='dot_product' or 'autoselected'"
    )
  return None


def _check(config: Config) -> list[str]:
  dense_layers = odd_rope = None
  if config.first_num_dense_layers > config.base_num_decoder_layers:
    dense_layers = (
        f"first_num_dense_layers={config.first_num_dense_layers} exceeds "
        f"base_num_decoder_layers={config.base_num_decoder_layers}"
    )
  if config.qk_rope_head_dim % 2:
    odd_rope = f"qk_rope_head_dim={config.qk_rope_head_dim} must be even (RoPE rotates pairs)"
  return broken(
      _mla_rope(config),
      routes_to_experts(config),
      no_grouped_query_attention(config),
      own_attention(config),
      dense_layers,
      odd_rope,
      _routing_groups(config),
      _router_bias(config),
      _indexer(config),
  )


FAMILY = Family(
    decoder_blocks=("deepseek",),
    # MaxText's names: the first `first_num_dense_layers` layers have a dense MLP, the rest routed experts.
    stacks=(
        Stack("dense_layers", "deepseek_dense", lambda config: config.first_num_dense_layers),
        Stack("moe_layers", "deepseek_moe", lambda config: config.num_decoder_layers - config.first_num_dense_layers),
    ),
    norm="rms_norm",
    query_kernel_carries_scale=False,  # MLA scales by 1/sqrt(nope + rope) at run time
    cache_entries=_latent_cache,
    qk_clip_targets=_qk_clip_targets,
    hf=(
        HFFamily(
            "deepseek_v2",
            "DeepseekV2ForCausalLM",
            ("deepseek",),
            V2_RULES,
            _v2_config_from_hf,
            _v2_config_to_hf,
            V2_CONFIG_CLASS,
            exports=lambda config: config.routed_score_func == "softmax",
        ),
        HFFamily(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            ("deepseek",),
            RULES,
            _config_from_hf,
            _config_to_hf,
            CONFIG_CLASS,
            mtp_copies=MTP_COPIES,
            exports=lambda config: not config.use_indexer,
        ),
        HFFamily(
            "deepseek_v32",
            "DeepseekV32ForCausalLM",
            ("deepseek",),
            V32_RULES,
            _v32_config_from_hf,
            _v32_config_to_hf,
            V32_CONFIG_CLASS,
            mtp_copies=MTP_COPIES,
        ),
        # Kimi-K2's folders: DeepseekV3ForCausalLM under model_type kimi_k2 (its config.json's auto_map builds
        # DeepseekV3Config). Read as V3; a config exports as deepseek_v3, which transformers loads without remote code.
        HFFamily(
            "kimi_k2",
            "DeepseekV3ForCausalLM",
            ("deepseek",),
            RULES,
            _config_from_hf,
            _config_to_hf,
            CONFIG_CLASS,
            mtp_copies=MTP_COPIES,
            exports=lambda config: False,
        ),
    ),
    check=_check,
    # MLA's YaRN only (other families' YaRN always scales the cos/sin and leaves the softmax scale).
    own_keys={
        "mscale": 1.0,
        "rope_attention_scaling": False,
        # DeepSeek-V3.2's lightning indexer (MaxText's names and defaults).
        "use_indexer": False,
        "indexer_n_heads": 64,
        "indexer_head_dim": 128,
        "indexer_topk": 2048,
    },
)
