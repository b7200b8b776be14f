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
from maxbridge.core.families.hf_rules import HFError, HFFamily, Linear, Rule, get_float, get_int

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

_llama_config_from_hf = llama.config_from_hf("mixtral", window=True)
_llama_config_to_hf = llama.config_to_hf("mixtral", window=True)


def _config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  return {
      **_llama_config_from_hf(hf),
      "num_experts": get_int(hf, "num_local_experts"),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "load_balance_loss_weight": get_float(hf, "router_aux_loss_coef", 0.0),
  }


def _config_to_hf(cfg: Config) -> dict[str, Any]:
  hf = _llama_config_to_hf(cfg)
  if cfg.routed_score_func or cfg.routed_bias or cfg.routed_scaling_factor != 1.0:
    raise HFError(
        "Mixtral routes by softmax over the top-k logits: routed_score_func='', "
        "routed_bias=false and routed_scaling_factor=1 are needed for an export"
    )
  hf.update(
      num_local_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      router_aux_loss_coef=cfg.load_balance_loss_weight,
  )
  return hf


FAMILY = Family(
    decoder_blocks=("mixtral",),
    stacks=(Stack("layers", "mixtral"),),
    norm="rms_norm",
    query_kernel_carries_scale=True,
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,
    hf=(HFFamily("mixtral", "MixtralForCausalLM", ("mixtral",), RULES, _config_from_hf, _config_to_hf),),
    check=lambda config: broken(routes_to_experts(config)),
)
