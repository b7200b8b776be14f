"""Llama 2 and 3, Mistral, Qwen3: one layer ("llama"); what differs between them is config.

Mistral adds a sliding window (`sliding_window_size`), Qwen3 query/key norms
(`use_qk_norm`). Mixtral and DeepSeek reuse this module's Hugging Face tables.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from maxbridge.core.families.base import Config, Family, Stack, key_value_cache, query_kernel_clip
from maxbridge.core.families.hf_rules import (
    common_to_hf,
    CONFIG_FILE,
    HFError,
    HFFamily,
    Linear,
    Rule,
    ConfigClass,
    get_bool,
    get_float,
    get_int,
    head_dim,
    query_scale,
    require,
    require_one_of,
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


# transformers' class defaults of what each model reads (tests compare them with transformers').
_LLAMA_LAYER_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "head_dim": None,
}
LLAMA_CONFIG = ConfigClass(
    "LlamaConfig",
    {
        **_LLAMA_LAYER_DEFAULTS,
        "intermediate_size": 11008,
        "num_key_value_heads": None,
        "attention_bias": False,
        "mlp_bias": False,
    },
)
MISTRAL_CONFIG = ConfigClass(
    "MistralConfig",
    {
        **_LLAMA_LAYER_DEFAULTS,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
)
QWEN3_CONFIG = ConfigClass(
    "Qwen3Config",
    {
        **_LLAMA_LAYER_DEFAULTS,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
    },
)


def config_from_hf(
    decoder_block: str,
    config_class: ConfigClass,
    *,
    biases: tuple[str, ...] = (),
    window: Callable[[Mapping[str, Any]], int] | None = None,
    qk_norm: bool = False,
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
  """The reader of a Llama-layer config.json.

  `biases`: the bias switches its transformers model reads (others build no
  bias); `window`: its sliding window's reader, where it has one; `qk_norm`:
  it has q/k norms.
  """

  def read(raw: Mapping[str, Any]) -> dict[str, Any]:
    hf = config_class.read(raw)
    require_one_of(hf, "hidden_act", ("silu", "swish"))  # the same SiLU in transformers' ACT2FN
    for bias in biases:
      require(hf, bias, False, False)
    heads = get_int(hf, "num_attention_heads")
    return {
        "decoder_block": decoder_block,
        "base_emb_dim": get_int(hf, "hidden_size"),
        "base_num_query_heads": heads,
        "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
        "head_dim": head_dim(hf, "hidden_size", "num_attention_heads"),
        "base_mlp_dim": get_int(hf, "intermediate_size"),
        "base_num_decoder_layers": get_int(hf, "num_hidden_layers"),
        "vocab_size": get_int(hf, "vocab_size"),
        "normalization_layer_epsilon": get_float(hf, "rms_norm_eps"),
        **rope_from_hf(hf, llama3=True, default_theta=config_class.default_theta),
        "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
        "use_qk_norm": qk_norm,
        "sliding_window_size": window(hf) if window else 0,
    }

  return read


def mistral_window(hf: Mapping[str, Any]) -> int:
  """Mistral's and Mixtral's one window for every layer; null: none."""
  return get_int(hf, "sliding_window", 0)


def qwen_window(decoder_block: str) -> Callable[[Mapping[str, Any]], int]:
  """Qwen2's and Qwen3's window reader: none, else refused naming the layers transformers would window."""

  def window(hf: Mapping[str, Any]) -> int:
    # Their configs' __post_init__: a window only with use_sliding_window, on the
    # layers from max_window_layers on, unless layer_types names each layer's kind.
    size = hf["sliding_window"] if get_bool(hf, "use_sliding_window") else None
    layers = get_int(hf, "num_hidden_layers")
    kinds, field = hf["layer_types"], "layer_types"
    if kinds is None:
      first = get_int(hf, "max_window_layers")
      kinds = ["sliding_attention" if size is not None and i >= first else "full_attention" for i in range(layers)]
      field = f"use_sliding_window=true with max_window_layers={first}"
    if not isinstance(kinds, list) or len(kinds) != layers:
      raise HFError(f"{CONFIG_FILE}: layer_types={kinds!r} must list one kind per layer ({layers})")
    windowed = [i for i, kind in enumerate(kinds) if kind not in ("full_attention", "attention")]
    if windowed:
      raise HFError(
          f"{CONFIG_FILE}: {field} gives layers {windowed} a sliding window; maxbridge's {decoder_block} attends in "
          "full on every layer"
      )
    return 0

  return window


def config_to_hf(
    model_type: str, *, window: bool = False, qk_norm: bool = False, fixed: Mapping[str, Any] | None = None
) -> Callable[[Config], dict[str, Any]]:
  """The writer of a Llama-layer config.json; `fixed`: keys it always writes (what the model type cannot vary)."""

  def write(config: Config) -> dict[str, Any]:
    if config.use_qk_norm != qk_norm:
      raise HFError(f"use_qk_norm={config.use_qk_norm} has no Hugging Face {model_type} equivalent")
    if config.sliding_window_size and not window:
      raise HFError(f"sliding_window_size={config.sliding_window_size} needs decoder_block='mistral'")
    hf = {
        **common_to_hf(config),
        "hidden_act": "silu",
        **rope_to_hf(config),
        **(fixed or {}),
    }
    if window:
      hf["sliding_window"] = config.sliding_window_size or None
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
            config_from_hf("llama2", LLAMA_CONFIG, biases=("attention_bias", "mlp_bias")),
            config_to_hf("llama", fixed={"attention_bias": False, "mlp_bias": False}),
            LLAMA_CONFIG,
        ),
        HFFamily(
            "mistral",
            "MistralForCausalLM",
            ("mistral",),
            RULES,
            config_from_hf("mistral", MISTRAL_CONFIG, window=mistral_window),
            config_to_hf("mistral", window=True),
            MISTRAL_CONFIG,
        ),
        HFFamily(
            "qwen3",
            "Qwen3ForCausalLM",
            ("qwen3",),
            RULES,
            config_from_hf("qwen3", QWEN3_CONFIG, biases=("attention_bias",), window=qwen_window("qwen3"), qk_norm=True),
            config_to_hf(
                "qwen3",
                qk_norm=True,
                fixed={"attention_bias": False, "use_sliding_window": False, "sliding_window": None, "layer_types": None},
            ),
            QWEN3_CONFIG,
        ),
    ),
    check=_check,
)
