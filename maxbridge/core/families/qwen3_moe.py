"""Qwen3-MoE: Qwen3's attention (a query/key RMSNorm per head) with routed experts for the MLP, none shared.

MaxText's `qwen3_moe`. The router takes a softmax over every expert and keeps
the top k (`routed_score_func='softmax'`); `norm_topk_prob` rescales the k
weights to sum to 1, which is Mixtral's routing (`routed_score_func=''`, as
MaxText's presets leave it).
"""

from __future__ import annotations

from typing import Any, Mapping

from maxbridge.core.families import llama
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
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Rule,
    get_bool,
    get_float,
    get_int,
)

# Qwen3-Next's MoE routes as this one does, and reads its router and experts by the same names.
EXPERT_RULES = (
    # Hugging Face keeps one tensor per expert on disk; ours stacks them on axis 0.
    Rule("model.layers.{layer}.mlp.gate.weight", "{layer}/moe_block/gate/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", "{layer}/moe_block/wi_0", Linear()),
    Rule("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", "{layer}/moe_block/wi_1", Linear()),
    Rule("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", "{layer}/moe_block/wo", Linear()),
)
RULES = llama.COMMON_RULES + llama.ATTENTION_RULES + EXPERT_RULES

# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "Qwen3MoeConfig",
    {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None,
    },
    # The attribute_map runs backwards here: num_experts is the field, num_local_experts the alias (`_experts`).
    aliases={"num_experts": "num_local_experts"},
)


def _window(hf: Mapping[str, Any]) -> int:
  # Qwen3MoeConfig's __post_init__ drops the window without use_sliding_window; with it, every layer is windowed.
  return get_int(hf, "sliding_window", 0) if get_bool(hf, "use_sliding_window") else 0


_llama_config_from_hf = llama.config_from_hf(
    "qwen3_moe", CONFIG_CLASS, biases=("attention_bias",), window=_window, qk_norm=True
)
_llama_config_to_hf = llama.config_to_hf("qwen3_moe", window=True, qk_norm=True, fixed={"attention_bias": False})


def _experts(raw: Mapping[str, Any], hf: Mapping[str, Any]) -> int:
  # num_local_experts (what save_pretrained writes) is set after the num_experts field, so it wins.
  if "num_local_experts" in raw:
    return get_int(raw, "num_local_experts")
  return get_int(hf, "num_experts")


def every_layer_routes(hf: Mapping[str, Any], decoder_block: str) -> None:
  # transformers gives a layer the dense MLP when it is listed in mlp_only_layers or (index + 1) is not a
  # multiple of decoder_sparse_step; maxbridge's qwen3_moe and qwen3_next stack MoE layers only.
  step = get_int(hf, "decoder_sparse_step")
  if step != 1:
    raise HFError(
        f"{CONFIG_FILE}: decoder_sparse_step={step} gives some layers a dense MLP; maxbridge's {decoder_block} "
        "routes every layer to experts (decoder_sparse_step=1)"
    )
  dense = hf["mlp_only_layers"]
  if dense:
    raise HFError(
        f"{CONFIG_FILE}: mlp_only_layers={dense!r} gives those layers a dense MLP; maxbridge's {decoder_block} "
        "routes every layer to experts (mlp_only_layers=[])"
    )


def check_unscaled_softmax(config: Config, model: str) -> None:
  """Refuses an export that routes otherwise than Hugging Face's Qwen3 MoEs (`model` names the architecture)."""
  if config.routed_bias or config.routed_scaling_factor != 1.0:
    raise HFError(
        f"{model} routes by a softmax over the experts, unscaled: routed_bias=false and routed_scaling_factor=1 "
        "are needed for an export"
    )


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  every_layer_routes(hf, "qwen3_moe")
  # transformers adds the router's auxiliary loss only where output_router_logits asks for router logits.
  aux = get_float(hf, "router_aux_loss_coef") if get_bool(hf, "output_router_logits") else 0.0
  return {
      **_llama_config_from_hf(raw),
      "num_experts": _experts(raw, hf),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "moe_mlp_dim": get_int(hf, "moe_intermediate_size"),
      "routed_score_func": "softmax",
      "norm_topk_prob": get_bool(hf, "norm_topk_prob"),
      "load_balance_loss_weight": aux,
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  hf = _llama_config_to_hf(config)
  check_unscaled_softmax(config, "Qwen3-MoE")
  hf.update(
      num_local_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      moe_intermediate_size=config.moe_mlp_dim,
      # Mixtral's routing ('') is the softmax's top k renormalised.
      norm_topk_prob=config.norm_topk_prob or config.routed_score_func == "",
      use_sliding_window=bool(config.sliding_window_size),
      decoder_sparse_step=1,
      mlp_only_layers=[],
      output_router_logits=config.load_balance_loss_weight > 0,
  )
  if config.load_balance_loss_weight > 0:  # else an imported config's coefficient is kept, and unused
    hf["router_aux_loss_coef"] = config.load_balance_loss_weight
  return hf


def _check(config: Config) -> list[str]:
  qk_norm = None
  if not config.use_qk_norm:
    qk_norm = "decoder_block='qwen3_moe' normalises each query and key head: set use_qk_norm=true"
  routing = None
  if config.routed_score_func not in ("", "softmax") or config.routed_bias:
    routing = (
        f"decoder_block='qwen3_moe' routes by a softmax over its experts: routed_score_func="
        f"{config.routed_score_func!r} and routed_bias={config.routed_bias} must be 'softmax' (or '') and false"
    )
  return broken(qk_norm, routes_to_experts(config), routing)


FAMILY = Family(
    decoder_blocks=("qwen3_moe",),
    stacks=(Stack("layers", "qwen3_moe"),),
    norm="rms_norm",
    query_kernel_carries_scale=True,  # but use_qk_norm, which this family needs, turns it off
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,
    hf=(
        HFFamily("qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",), RULES, _config_from_hf, _config_to_hf, CONFIG_CLASS),
    ),
    check=_check,
)
