"""Llama 2 and 3, Mistral, Qwen3: one layer ("llama"); what differs between them is config.

Mistral adds a sliding window (`sliding_window_size`), Qwen3 query/key norms
(`use_qk_norm`). Mixtral and DeepSeek reuse this module's Hugging Face tables.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from maxbridge.core.families.base import Config, Family, Stack, key_value_cache, query_kernel_clip
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    HFError,
    HFFamily,
    Linear,
    Rule,
    get_bool,
    get_float,
    get_int,
    head_dim,
    query_scale,
    require,
    rope_from_hf,
    rope_to_hf,
)

ATTENTION_RULES = (
    Rule(
        "model.layers.{layer}.self_attn.q_proj.weight",
        "{layer}/self_attention/query/kernel",
        Linear(scale=query_scale),
    ),
    Rule("model.layers.{layer}.self_attn.k_proj.weight", "{layer}/self_attention/key/kernel", Linear()),
    Rule("model.layers.{layer}.self_attn.v_proj.weight", "{layer}/self_attention/value/kernel", Linear()),
    Rule("model.layers.{layer}.self_attn.o_proj.weight", "{layer}/self_attention/out/kernel", Linear(in_ndim=2)),
    Rule("model.layers.{layer}.self_attn.q_norm.weight", "{layer}/self_attention/query_norm/scale"),
    Rule("model.layers.{layer}.self_attn.k_norm.weight", "{layer}/self_attention/key_norm/scale"),
)
COMMON_RULES = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding"),
    Rule("model.norm.weight", "decoder/decoder_norm/scale"),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
    Rule("model.layers.{layer}.input_layernorm.weight", "{layer}/pre_self_attention_layer_norm/scale"),
    Rule("model.layers.{layer}.post_attention_layernorm.weight", "{layer}/post_self_attention_layer_norm/scale"),
)
GATED_MLP_RULES = (
    Rule("model.layers.{layer}.mlp.gate_proj.weight", "{layer}/mlp/wi_0/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.up_proj.weight", "{layer}/mlp/wi_1/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.down_proj.weight", "{layer}/mlp/wo/kernel", Linear()),
)
RULES = COMMON_RULES + ATTENTION_RULES + GATED_MLP_RULES


def config_from_hf(
    decoder_block: str, *, window: bool = False, qk_norm: bool = False
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
  """The reader of a Llama-layer config.json; `window`: it may have a sliding window, `qk_norm`: it has q/k norms."""

  def read(hf: Mapping[str, Any]) -> dict[str, Any]:
    require(hf, "hidden_act", "silu", "silu")
    require(hf, "attention_bias", False, False)
    require(hf, "mlp_bias", False, False)
    heads = get_int(hf, "num_attention_heads")
    values = {
        "decoder_block": decoder_block,
        "base_emb_dim": get_int(hf, "hidden_size"),
        "base_num_query_heads": heads,
        "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
        "head_dim": head_dim(hf, "hidden_size", "num_attention_heads"),
        "base_mlp_dim": get_int(hf, "intermediate_size"),
        "base_num_decoder_layers": get_int(hf, "num_hidden_layers"),
        "vocab_size": get_int(hf, "vocab_size"),
        "normalization_layer_epsilon": get_float(hf, "rms_norm_eps", 1e-6),
        **rope_from_hf(hf, llama3=True),
        "logits_via_embedding": get_bool(hf, "tie_word_embeddings", False),
        "use_qk_norm": qk_norm,
        "sliding_window_size": get_int(hf, "sliding_window", 0) if window else 0,
    }
    if qk_norm and get_bool(hf, "use_sliding_window", False):
      raise HFError(f"{CONFIG_FILE}: use_sliding_window=true (Qwen3's per-layer windows) is not supported")
    return values

  return read


def config_to_hf(
    model_type: str, *, window: bool = False, qk_norm: bool = False, fixed: Mapping[str, Any] | None = None
) -> Callable[[Config], dict[str, Any]]:
  """The writer of a Llama-layer config.json; `fixed`: keys it always writes (what the model type cannot vary)."""

  def write(cfg: Config) -> dict[str, Any]:
    if cfg.use_qk_norm != qk_norm:
      raise HFError(f"use_qk_norm={cfg.use_qk_norm} has no Hugging Face {model_type} equivalent")
    if cfg.sliding_window_size and not window:
      raise HFError(f"sliding_window_size={cfg.sliding_window_size} needs decoder_block='mistral'")
    hf = {
        "hidden_size": cfg.emb_dim,
        "num_attention_heads": cfg.num_query_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_decoder_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.logits_via_embedding,
        **rope_to_hf(cfg),
        **(fixed or {}),
    }
    if window:
      hf["sliding_window"] = cfg.sliding_window_size or None
    return hf

  return write


def _check(config: Config) -> list[str]:
  # No rule that mistral has a window: Mistral 7B v0.2 and later have none
  # (Hugging Face's sliding_window: null), and import as sliding_window_size=0.
  if config.decoder_block == "qwen3" and not config.use_qk_norm:
    return [
        "decoder_block='qwen3' normalises each query and key head: set use_qk_norm=true "
        "(without it the model is decoder_block='llama2')"
    ]
  return []


FAMILY = Family(
    decoder_blocks=("llama2", "mistral", "qwen3"),
    stacks=(Stack("layers", "llama"),),
    norm="rms_norm",
    query_kernel_carries_scale=True,
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,
    hf=(
        HFFamily(
            "llama",
            "LlamaForCausalLM",
            ("llama2",),
            RULES,
            config_from_hf("llama2"),
            config_to_hf("llama", fixed={"attention_bias": False, "mlp_bias": False}),
        ),
        HFFamily(
            "mistral",
            "MistralForCausalLM",
            ("mistral",),
            RULES,
            config_from_hf("mistral", window=True),
            config_to_hf("mistral", window=True),
        ),
        HFFamily(
            "qwen3",
            "Qwen3ForCausalLM",
            ("qwen3",),
            RULES,
            config_from_hf("qwen3", qk_norm=True),
            config_to_hf(
                "qwen3",
                qk_norm=True,
                fixed={"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
            ),
        ),
    ),
    check=_check,
)
