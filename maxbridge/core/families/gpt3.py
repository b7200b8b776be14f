"""GPT-2/3: learned positions, LayerNorm with a bias, a fused `qkv_proj`, a GELU MLP with biases."""

from __future__ import annotations

from typing import Any, Mapping

from maxbridge.core.families.base import (
    ClipPiece,
    ClipTargets,
    Config,
    Family,
    Stack,
    broken,
    key_value_cache,
    no_grouped_query_attention,
    own_attention,
    own_positions,
)
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Reshape,
    Rule,
    get_bool,
    get_float,
    get_int,
    require,
    require_one_of,
)

RULES = (
    Rule("transformer.wte.weight", "token_embedder/embedding"),
    Rule("transformer.wpe.weight", "decoder/position_embedder/embedding"),
    Rule("transformer.ln_f.weight", "decoder/decoder_norm/scale"),
    Rule("transformer.ln_f.bias", "decoder/decoder_norm/bias"),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
    Rule("transformer.h.{layer}.ln_1.weight", "{layer}/pre_self_attention_norm/scale"),
    Rule("transformer.h.{layer}.ln_1.bias", "{layer}/pre_self_attention_norm/bias"),
    # GPT-2's Conv1D weights are [in, out] already: q, k, v then heads in c_attn's columns.
    Rule("transformer.h.{layer}.attn.c_attn.weight", "{layer}/self_attention/qkv_proj/kernel", Reshape(in_ndim=1)),
    Rule("transformer.h.{layer}.attn.c_attn.bias", "{layer}/self_attention/qkv_proj/bias", Reshape()),
    Rule("transformer.h.{layer}.attn.c_proj.weight", "{layer}/self_attention/out/kernel", Reshape(in_ndim=2)),
    Rule("transformer.h.{layer}.attn.c_proj.bias", "{layer}/self_attention/out/bias"),
    Rule("transformer.h.{layer}.ln_2.weight", "{layer}/mlp/mlp_layer_norm/scale"),
    Rule("transformer.h.{layer}.ln_2.bias", "{layer}/mlp/mlp_layer_norm/bias"),
    Rule("transformer.h.{layer}.mlp.c_fc.weight", "{layer}/mlp/wi/kernel"),
    Rule("transformer.h.{layer}.mlp.c_fc.bias", "{layer}/mlp/wi/bias"),
    Rule("transformer.h.{layer}.mlp.c_proj.weight", "{layer}/mlp/wo/kernel"),
    Rule("transformer.h.{layer}.mlp.c_proj.bias", "{layer}/mlp/wo/bias"),
)


def _hf_name(name: str) -> str:
  # The original GPT-2 checkpoints name tensors without the "transformer." prefix.
  return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"


# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "GPT2Config",
    {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
    },
    aliases={
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    },
)
# transformers' names for GELU's tanh approximation, the one our gpt3 block computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast")


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  require_one_of(hf, "activation_function", TANH_GELUS)
  require(hf, "scale_attn_weights", True, True)
  require(hf, "scale_attn_by_inverse_layer_idx", False, False)
  require(hf, "add_cross_attention", False, False)
  get_bool(hf, "reorder_and_upcast_attn")  # either value: the same float32 attention (FIELDS.md)
  width, heads = get_int(hf, "n_embd"), get_int(hf, "n_head")
  if heads <= 0 or width % heads:
    raise HFError(f"{CONFIG_FILE}: n_embd={width} is not a multiple of n_head={heads}")
  # Not a GPT2Config field, and transformers' GPT-2 never reads it; one that disagrees describes another model.
  if hf.get("head_dim") is not None and hf["head_dim"] != width // heads:
    raise HFError(
        f"{CONFIG_FILE}: head_dim={hf['head_dim']!r} is not n_embd / n_head = {width // heads}, "
        "the width of GPT-2's heads"
    )
  positions = get_int(hf, "n_positions")
  return {
      "decoder_block": "gpt3",
      "base_emb_dim": width,
      "base_num_query_heads": heads,
      "base_num_kv_heads": heads,
      "head_dim": width // heads,
      "base_mlp_dim": get_int(hf, "n_inner", 4 * width),
      "base_num_decoder_layers": get_int(hf, "n_layer"),
      "vocab_size": get_int(hf, "vocab_size"),
      "trainable_position_size": positions,
      # The learned table bounds every sequence: no longer than n_positions.
      "max_target_length": positions,
      "normalization_layer_epsilon": get_float(hf, "layer_norm_epsilon"),
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  if config.head_dim * config.num_query_heads != config.emb_dim:
    raise HFError(
        f"GPT-2 needs head_dim * heads == emb_dim; got head_dim={config.head_dim}, "
        f"base_num_query_heads={config.num_query_heads}, base_emb_dim={config.emb_dim}"
    )
  return {
      "n_embd": config.emb_dim,
      "n_head": config.num_query_heads,
      "n_inner": config.mlp_dim,
      "n_layer": config.num_decoder_layers,
      "vocab_size": config.vocab_size,
      "n_positions": config.trainable_position_size,
      "layer_norm_epsilon": config.normalization_layer_epsilon,
      "activation_function": "gelu_new",
      "scale_attn_weights": True,
      "scale_attn_by_inverse_layer_idx": False,
      "tie_word_embeddings": config.logits_via_embedding,
  }


def _qk_clip_targets(config: Config) -> ClipTargets:
  # Fused [D, 3, N, H]: the query is index 0 of the "qkv" axis.
  return {
      "self_attention/qkv_proj/kernel": (2, (ClipPiece(1, 0, 1, 1.0),)),
      "self_attention/qkv_proj/bias": (1, (ClipPiece(0, 0, 1, 1.0),)),
  }


def _check(config: Config) -> list[str]:
  positions = None
  if config.trainable_position_size == 0:
    positions = (
        "decoder_block='gpt3' learns absolute positions: set trainable_position_size "
        "(the longest sequence it can read, e.g. max_target_length)"
    )
  return broken(own_positions(config), no_grouped_query_attention(config), own_attention(config), positions)


FAMILY = Family(
    decoder_blocks=("gpt3",),
    stacks=(Stack("layers", "gpt3"),),
    norm="layer_norm",
    query_kernel_carries_scale=False,  # the fused qkv_proj has no query kernel of its own
    # Multi-head attention: as many key/value heads as query heads.
    cache_entries=lambda config: key_value_cache(config, kv_heads=config.num_query_heads),
    qk_clip_targets=_qk_clip_targets,
    hf=(
        HFFamily(
            "gpt2",
            "GPT2LMHeadModel",
            ("gpt3",),
            RULES,
            _config_from_hf,
            _config_to_hf,
            CONFIG_CLASS,
            normalize_name=_hf_name,
            ignored=(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",),
        ),
    ),
    check=_check,
)
