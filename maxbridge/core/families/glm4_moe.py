"""GLM-4.5 and GLM-4.5-Air (Hugging Face `glm4_moe`): Llama's attention with biases and partial RoPE, then
DeepSeek-V3's routed + shared experts.

Attention: grouped-query, biases on the query, key and value projections (none
on `out`), an optional per-head query/key RMSNorm (`use_qk_norm`: GLM-4.5 has
it, Air not), and RoPE on the first `partial_rotary_factor` of each head's dims
only (0.5 in every release), pairs (i, i + rotary_dim / 2) as Hugging Face's
`rotate_half`: `attention.PARTIAL_ROPE`, as Qwen3-Next. The query kernel does
not carry 1/sqrt(head_dim) (its bias would have to); attention scales at run time.

MLP: the first `first_num_dense_layers` layers a dense SwiGLU (`base_mlp_dim`),
the rest DeepSeek-V3's block (`DeepSeekMoeBlock_0`: routed experts of
`moe_mlp_dim` plus `shared_experts` always on), routed as DeepSeek-V3 routes
(`ops.moe.group_limited_sigmoid`: sigmoid scores, experts chosen by score plus
the correction bias `gate/bias`, within the `topk_routing_group` best of
`n_routing_groups` groups, weights renormalised then times
`routed_scaling_factor`), which is transformers' Glm4MoeTopkRouter with
norm_topk_prob; norm_topk_prob=false is refused by name.

GLM-4.5's checkpoints store a multi-token prediction layer after the decoder's
(`model.layers.{num_hidden_layers}`), which transformers' Glm4MoeForCausalLM
leaves out; maxbridge does not run it either: an import that finds one refuses
it by name (`mtp_num_layers`), and `mtp_num_layers=0` leaves it out.
"""

from __future__ import annotations

from typing import Any, Mapping

from maxbridge.core.families import attention as attn
from maxbridge.core.families import deepseek, deepseek_hf, llama, qwen2
from maxbridge.core.families.base import (
    ClipPiece,
    ClipTargets,
    Config,
    Family,
    Stack,
    broken,
    key_value_cache,
    own_positions,
    routes_to_experts,
)
from maxbridge.core.families.hf_rules import (
    ConfigClass,
    HFError,
    HFFamily,
    Rule,
    common_to_hf,
    get_bool,
    get_float,
    get_int,
    head_dim,
    require,
    require_one_of,
    rope_from_hf,
    rope_to_hf,
)

_ATTENTION = "model.layers.{layer}.self_attn"
_MOE_RULES = tuple(rule for rule in deepseek_hf.RULES if "DeepSeekMoeBlock_0" in rule.ours)
# The multi-token prediction layer's own tensors, by DeepSeek-V3's names (GLM-4.5 stores them so): only to find a
# stored MTP layer, which `_check` refuses (`mtp_num_layers`) and `mtp_num_layers=0` leaves out.
_MTP_RULES = tuple(rule for rule in deepseek_hf.RULES if rule.ours.startswith("{mtp}/"))
RULES = (
    *llama.COMMON_RULES,
    *qwen2.QKV_BIAS_ATTENTION_RULES,
    Rule(f"{_ATTENTION}.q_norm.weight", "{layer}/self_attention/query_norm/scale"),
    Rule(f"{_ATTENTION}.k_norm.weight", "{layer}/self_attention/key_norm/scale"),
    *llama.GATED_MLP_RULES,  # the dense layers
    *_MOE_RULES,
    *_MTP_RULES,
)

# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "Glm4MoeConfig",
    {
        "vocab_size": 151552,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "attention_bias": False,
        "moe_intermediate_size": 1408,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_routed_experts": 128,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "use_qk_norm": False,
    },
    aliases={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
)
# Glm4MoeConfig's partial_rotary_factor where its RoPE parameters give none (its __post_init__'s).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def rotary_dim(config: Config) -> int:
  """The leading dims of each head that RoPE turns (Hugging Face's int(head_dim * partial_rotary_factor))."""
  return int(config.head_dim * config.partial_rotary_factor)


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """Grouped-query attention with q/k/v biases, Qwen3's optional QK-norm, and partial RoPE; scaled at run time."""
  del local, kv_shared  # every layer alike
  partial = rotary_dim(config) < config.head_dim
  return attn.AttentionSpec(
      head_dim=config.head_dim,
      kv_heads=config.num_kv_heads,
      qkv_bias=True,
      qk_norm=attn.RMS_NORM if config.use_qk_norm else None,
      rope=attn.PARTIAL_ROPE if partial else attn.ROPE,
      rotary_dim=rotary_dim(config) if partial else 0,
      query_scale=config.head_dim**-0.5,
  )


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  require_one_of(hf, "hidden_act", ("silu", "swish"))
  # Every released GLM-4.5 has them; without them the projections would have none (zeros would do, but there is
  # nothing to read them from).
  require(hf, "attention_bias", True, False)
  require(hf, "norm_topk_prob", True, True)
  heads = get_int(hf, "num_attention_heads")
  return {
      "decoder_block": "glm4_moe",
      "base_emb_dim": get_int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
      # Not a Glm4MoeConfig field, but its attention reads it (GLM-4.5's config.json gives 128).
      "head_dim": head_dim(hf, "hidden_size", "num_attention_heads"),
      "base_mlp_dim": get_int(hf, "intermediate_size"),
      "base_num_decoder_layers": get_int(hf, "num_hidden_layers"),
      "vocab_size": get_int(hf, "vocab_size"),
      "normalization_layer_epsilon": get_float(hf, "rms_norm_eps"),
      **rope_from_hf(
          hf, llama3=False, default_theta=CONFIG_CLASS.default_theta, partial_rotary_default=DEFAULT_PARTIAL_ROTARY_FACTOR
      ),
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
      "use_qk_norm": get_bool(hf, "use_qk_norm"),
      **deepseek_hf.moe_from_hf(hf),
      "n_routing_groups": get_int(hf, "n_group"),
      "topk_routing_group": get_int(hf, "topk_group"),
      "routed_score_func": "sigmoid",
      "routed_bias": True,
      "norm_topk_prob": True,
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  if config.mtp_num_layers:
    raise HFError(f"mtp_num_layers={config.mtp_num_layers}: maxbridge's glm4_moe has no MTP layers to export")
  rope = rope_to_hf(config)
  rope["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
  hf = {
      **common_to_hf(config),
      "hidden_act": "silu",
      **rope,
      "attention_bias": True,
      "use_qk_norm": config.use_qk_norm,
      **deepseek_hf.moe_to_hf(config),
      "n_group": max(config.n_routing_groups, 1),
      "topk_group": max(config.topk_routing_group, 1),
      "norm_topk_prob": True,
      "output_router_logits": False,
      "num_nextn_predict_layers": 0,  # the folder holds none
  }
  hf.pop("rope_theta", None)
  return hf


def _qk_clip_targets(config: Config) -> ClipTargets:
  """The query kernel [D, N, H] and its bias [N, H], by s per query head: the head's queries, so its logits."""
  piece = lambda axis: (ClipPiece(axis, 0, config.head_dim, 1.0),)  # noqa: E731
  return {"self_attention/query/kernel": (1, piece(2)), "self_attention/query/bias": (0, piece(1))}


def _check(config: Config) -> list[str]:
  routing = rope = dense = window = mtp = None
  if config.routed_score_func != "sigmoid" or not config.routed_bias or not config.norm_topk_prob:
    routing = (
        f"decoder_block='glm4_moe' routes by sigmoid scores with a correction bias, its top-k weights renormalised: "
        f"routed_score_func={config.routed_score_func!r}, routed_bias={config.routed_bias} and norm_topk_prob="
        f"{config.norm_topk_prob} must be 'sigmoid', true and true"
    )
  if rotary_dim(config) % 2 or not rotary_dim(config):
    rope = (
        f"partial_rotary_factor={config.partial_rotary_factor} x head_dim={config.head_dim} = {rotary_dim(config)} "
        "dims: RoPE turns pairs, so it must give a positive even number"
    )
  if config.first_num_dense_layers > config.base_num_decoder_layers:
    dense = (
        f"first_num_dense_layers={config.first_num_dense_layers} exceeds "
        f"base_num_decoder_layers={config.base_num_decoder_layers}"
    )
  if config.sliding_window_size:
    window = f"sliding_window_size={config.sliding_window_size}: decoder_block='glm4_moe' attends in full on every layer"
  if config.mtp_num_layers:
    mtp = (
        f"mtp_num_layers={config.mtp_num_layers}: decoder_block='glm4_moe' runs no multi-token prediction layers "
        "(GLM-4.5's checkpoints store one, model.layers.{num_hidden_layers}.*, which transformers' "
        "Glm4MoeForCausalLM leaves out too); set mtp_num_layers=0, which leaves a stored one out of an import"
    )
  return broken(
      routing,
      routes_to_experts(config),
      own_positions(config),
      rope,
      dense,
      window,
      mtp,
      deepseek.routing_groups(config),
  )


FAMILY = Family(
    decoder_blocks=("glm4_moe",),
    # DeepSeek-V3's stacks: the first `first_num_dense_layers` layers have a dense MLP, the rest routed experts.
    stacks=(
        Stack("dense_layers", "llama", lambda config: config.first_num_dense_layers),
        Stack("moe_layers", "glm4_moe", lambda config: config.num_decoder_layers - config.first_num_dense_layers),
    ),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # the query bias would need the factor too; attention scales at run time
    cache_entries=key_value_cache,
    qk_clip_targets=_qk_clip_targets,
    hf=(
        HFFamily(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            ("glm4_moe",),
            RULES,
            _config_from_hf,
            _config_to_hf,
            CONFIG_CLASS,
            mtp_copies=deepseek_hf.MTP_COPIES,
        ),
    ),
    check=_check,
    own_keys={"partial_rotary_factor": 1.0},  # shared with qwen3_next, which reads it too
)
