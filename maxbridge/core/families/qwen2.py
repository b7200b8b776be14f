"""Qwen2 and Qwen2.5: Llama's layer ("llama") with biases on the query, key and value projections.

No QK-norm, no bias on the out projection, SwiGLU, RMSNorm, RoPE, an optional
tied head: as MaxText's Qwen2DecoderLayer (`attention_bias: true`, which its
qwen2 keeps off the out projection) and transformers' Qwen2ForCausalLM. The
query kernel does not carry 1/sqrt(head_dim) (its bias would have to carry it
too); attention scales at run time, as MaxText's `query_pre_attn_scalar` does,
so MaxText's and Hugging Face's query weights load unchanged. Qwen2Config's
sliding window (`use_sliding_window`, off in every released Qwen2.5) is refused
where it would window any layer, as Qwen3's.
"""

from __future__ import annotations

from maxbridge.core.families import attention as attn
from maxbridge.core.families import llama
from maxbridge.core.families.base import ClipPiece, ClipTargets, Config, Family, Stack, broken, key_value_cache
from maxbridge.core.families.hf_rules import ConfigClass, HFFamily, Linear, Reshape, Rule

_ATTENTION = "model.layers.{layer}.self_attn"
# Grouped-query attention with biases on the query, key and value projections, none on the output's (GLM-4.5's too).
QKV_BIAS_ATTENTION_RULES = (
    Rule(f"{_ATTENTION}.q_proj.weight", "{layer}/self_attention/query/kernel", Linear()),
    Rule(f"{_ATTENTION}.k_proj.weight", "{layer}/self_attention/key/kernel", Linear()),
    Rule(f"{_ATTENTION}.v_proj.weight", "{layer}/self_attention/value/kernel", Linear()),
    Rule(f"{_ATTENTION}.o_proj.weight", "{layer}/self_attention/out/kernel", Linear(in_ndim=2)),
    Rule(f"{_ATTENTION}.q_proj.bias", "{layer}/self_attention/query/bias", Reshape()),
    Rule(f"{_ATTENTION}.k_proj.bias", "{layer}/self_attention/key/bias", Reshape()),
    Rule(f"{_ATTENTION}.v_proj.bias", "{layer}/self_attention/value/bias", Reshape()),
)
RULES = (*llama.COMMON_RULES, *QKV_BIAS_ATTENTION_RULES, *llama.GATED_MLP_RULES)

# transformers' class defaults of what its model reads (tests compare them with transformers'). Qwen2Config has no
# head_dim field: Qwen2Attention reads a head_dim key where config.json has one, else hidden_size / heads.
CONFIG_CLASS = ConfigClass(
    "Qwen2Config",
    {
        key: value
        for key, value in llama.QWEN3_CONFIG.defaults.items()  # Qwen3Config's, less its head_dim and attention_bias
        if key not in ("head_dim", "attention_bias")
    },
)
_config_from_hf = llama.config_from_hf("qwen2", CONFIG_CLASS, window=llama.qwen_window("qwen2"))
_config_to_hf = llama.config_to_hf(
    "qwen2", fixed={"use_sliding_window": False, "sliding_window": None, "layer_types": None}
)


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """Llama's grouped-query attention with query, key and value biases; scaled at run time."""
  del local, kv_shared  # every layer alike
  return attn.AttentionSpec(
      head_dim=config.head_dim,
      kv_heads=config.num_kv_heads,
      qkv_bias=True,
      ring_cache=attn.ring_cache(config),
      query_scale=config.head_dim**-0.5,
  )


def _qk_clip_targets(config: Config) -> ClipTargets:
  """The query kernel [D, N, H] and its bias [N, H], by s per query head: the head's queries, so its logits."""
  piece = lambda axis: (ClipPiece(axis, 0, config.head_dim, 1.0),)  # noqa: E731
  return {"self_attention/query/kernel": (1, piece(2)), "self_attention/query/bias": (0, piece(1))}


def _check(config: Config) -> list[str]:
  norm = window = None
  if config.use_qk_norm:
    norm = "decoder_block='qwen2' has no query/key norms (Qwen3 is decoder_block='qwen3'): set use_qk_norm=false"
  if config.sliding_window_size:
    window = (
        f"sliding_window_size={config.sliding_window_size} with decoder_block='qwen2': maxbridge's qwen2 attends in "
        "full on every layer (Qwen2Config's use_sliding_window windows only some); set sliding_window_size=0"
    )
  return broken(norm, window)


FAMILY = Family(
    decoder_blocks=("qwen2",),
    stacks=(Stack("layers", "llama"),),  # Llama's layer: what differs is its attention's spec
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # the query bias would need the factor too; attention scales at run time
    cache_entries=key_value_cache,
    qk_clip_targets=_qk_clip_targets,
    hf=(HFFamily("qwen2", "Qwen2ForCausalLM", ("qwen2",), RULES, _config_from_hf, _config_to_hf, CONFIG_CLASS),),
    check=_check,
    maxtext_fixed={"attention_bias": True},  # MaxText's qwen2.5 files set it: its qwen2 biases q, k, v only, as here
)
