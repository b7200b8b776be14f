"""Mixtral: Llama's attention with a sliding window, and routed experts (softmax over the top-k) for the MLP."""

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
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Rule,
    get_bool,
    get_float,
    get_int,
)

# Routed experts: one Hugging Face tensor per expert, stacked on axis 0 of ours.
RULES = (
    llama.COMMON_RULES
    + llama.ATTENTION_RULES
    + (
        Rule("model.layers.{layer}.block_sparse_moe.gate.weight", "{layer}/MoeBlock_0/gate/kernel", Linear()),
        Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight", "{layer}/MoeBlock_0/wi_0", Linear()),
        Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight", "{layer}/MoeBlock_0/wi_1", Linear()),
        Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight", "{layer}/MoeBlock_0/wo", Linear()),
    )
)

# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "MixtralConfig",
    {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "rope_parameters": None,
    },
    aliases={"num_experts": "num_local_experts"},
    default_theta=1e6,
)
_llama_config_from_hf = llama.config_from_hf("mixtral", CONFIG_CLASS, window=llama.mistral_window)
_llama_config_to_hf = llama.config_to_hf("mixtral", window=True)


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  # transformers adds the router's auxiliary loss only where output_router_logits asks for router logits.
  aux = get_float(hf, "router_aux_loss_coef") if get_bool(hf, "output_router_logits") else 0.0
  return {
      **_llama_config_from_hf(raw),
      "num_experts": get_int(hf, "num_local_experts"),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "load_balance_loss_weight": aux,
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  hf = _llama_config_to_hf(config)
  if config.routed_score_func or config.routed_bias or config.routed_scaling_factor != 1.0:
    raise HFError(
        "Mixtral routes by softmax over the top-k logits: routed_score_func='', "
        "routed_bias=false and routed_scaling_factor=1 are needed for an export"
    )
  hf.update(
      num_local_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      output_router_logits=config.load_balance_loss_weight > 0,
  )
  if config.load_balance_loss_weight > 0:  # else an imported config's coefficient is kept, and unused
    hf["router_aux_loss_coef"] = config.load_balance_loss_weight
  return hf


FAMILY = Family(
    decoder_blocks=("mixtral",),
    stacks=(Stack("layers", "mixtral"),),
    norm="rms_norm",
    query_kernel_carries_scale=True,
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,
    hf=(HFFamily("mixtral", "MixtralForCausalLM", ("mixtral",), RULES, _config_from_hf, _config_to_hf, CONFIG_CLASS),),
    check=lambda config: broken(routes_to_experts(config)),
)
