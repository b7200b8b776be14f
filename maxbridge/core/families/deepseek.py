"""DeepSeek-V2 and V3: multi-head latent attention (MLA), dense layers then MoE layers with shared experts.

One decoder block ("deepseek", as MaxText's deepseek2-* and deepseek3-* files): what differs is data. V3 routes
by sigmoid scores with a correction bias (routed_score_func='sigmoid', routed_bias, groups ranked by their top
two), V2 by a softmax over the experts (routed_score_func='softmax', weights not renormalised, groups ranked by
their best expert: `ops.moe.group_limited_softmax`). Each imports from and exports to its own transformers class.
DeepSeek-V3.2 is V3 with a lightning indexer in each MLA layer (`use_indexer`, MaxText's keys `indexer_*`:
`ops.indexer`); Kimi-K2's folders (model_type kimi_k2) are DeepSeek-V3's architecture at other sizes, read as V3.
Their Hugging Face tensors and config.json are read and written in `deepseek_hf`.
"""

from __future__ import annotations


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
from maxbridge.core.families.hf_rules import HFFamily
from maxbridge.core.families.deepseek_hf import (
    CONFIG_CLASS,
    MTP_COPIES,
    RULES,
    V2_CONFIG_CLASS,
    V2_RULES,
    V32_CONFIG_CLASS,
    V32_RULES,
    v3_config_from_hf,
    v3_config_to_hf,
    v2_config_from_hf,
    v2_config_to_hf,
    v32_config_from_hf,
    v32_config_to_hf,
)


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


def routing_groups(config: Config) -> str | None:
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
      routing_groups(config),
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
            v2_config_from_hf,
            v2_config_to_hf,
            V2_CONFIG_CLASS,
            exports=lambda config: config.routed_score_func == "softmax",
        ),
        HFFamily(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            ("deepseek",),
            RULES,
            v3_config_from_hf,
            v3_config_to_hf,
            CONFIG_CLASS,
            mtp_copies=MTP_COPIES,
            exports=lambda config: not config.use_indexer,
        ),
        HFFamily(
            "deepseek_v32",
            "DeepseekV32ForCausalLM",
            ("deepseek",),
            V32_RULES,
            v32_config_from_hf,
            v32_config_to_hf,
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
            v3_config_from_hf,
            v3_config_to_hf,
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
