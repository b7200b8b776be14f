"""OLMo 2: Llama's projections and MLP, with norms on each branch's output and QK-norm over whole projections.

A layer is x + norm(attention(x)), then x + norm(mlp(x)) (`post_self_attention_layer_norm`,
`post_mlp_layer_norm`, MaxText's names in its Olmo3DecoderLayer); there is no
norm before either branch. Queries and keys are RMS-normalised over all their
heads at once (`query_norm`/`key_norm` scales of heads * head_dim), so
`use_qk_norm` is part of the family and QK-Clip, which that norm undoes, is
refused by the config's shared rule.
"""

from __future__ import annotations

from typing import Any

from maxbridge.core.families import attention as attn
from maxbridge.core.families import llama
from maxbridge.core.families.base import Config, Family, Stack, key_value_cache, query_kernel_clip
from maxbridge.core.families.hf_rules import ConfigClass, HFError, HFFamily, Linear, Rule

RULES = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding"),
    Rule("model.norm.weight", "decoder/decoder_norm/scale"),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
    Rule("model.layers.{layer}.post_attention_layernorm.weight", "{layer}/post_self_attention_layer_norm/scale"),
    Rule("model.layers.{layer}.post_feedforward_layernorm.weight", "{layer}/post_mlp_layer_norm/scale"),
    *llama.ATTENTION_RULES,  # q_norm/k_norm are flat [heads * head_dim] on both sides
    *llama.GATED_MLP_RULES,
)

# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "Olmo2Config",
    {
        "vocab_size": 50304,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "attention_bias": False,
    },
)

_write = llama.config_to_hf("olmo2", qk_norm=True, fixed={"attention_bias": False})


def _config_to_hf(config: Config) -> dict[str, Any]:
  if config.sliding_window_size:
    raise HFError(
        f"sliding_window_size={config.sliding_window_size}: Hugging Face's olmo2 attends in full on every layer"
    )
  return _write(config)


def _check(config: Config) -> list[str]:
  if not config.use_qk_norm:
    return ["decoder_block='olmo2' normalises queries and keys over the whole projection: set use_qk_norm=true"]
  return []


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """Queries and keys RMS-normed over all their heads together, before RoPE; every layer has the config's window."""
  del local, kv_shared
  return attn.AttentionSpec(
      head_dim=config.head_dim,
      kv_heads=config.num_kv_heads,
      qk_norm=attn.ACROSS_HEADS,
      sliding_window_size=config.sliding_window_size,
      ring_cache=attn.ring_cache(config),
      query_scale=config.head_dim**-0.5,
  )


FAMILY = Family(
    decoder_blocks=("olmo2",),
    stacks=(Stack("layers", "olmo2"),),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # the QK-norm would undo it
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,
    hf=(
        HFFamily(
            "olmo2",
            "Olmo2ForCausalLM",
            ("olmo2",),
            RULES,
            llama.config_from_hf("olmo2", CONFIG_CLASS, biases=("attention_bias",), qk_norm=True),
            _config_to_hf,
            CONFIG_CLASS,
        ),
    ),
    check=_check,
)
