"""The Hugging Face families: per architecture, a table of tensor `Rule`s and the config mapping.

A `Rule` is a Hugging Face tensor name pattern, the canonical path it becomes
and a `Transform` (transpose, head reshape, query scaling). In patterns,
`{layer}` is the Hugging Face layer index and, in canonical paths, that
layer's unscanned path (`decoder/layers_3`, or DeepSeek's `decoder/moe_layers_0`);
`{expert}` marks per-expert Hugging Face tensors stacked on axis 0 of one
canonical array. `maxbridge.hf.mapping` applies the tables; nothing else
knows a Hugging Face name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import rotary

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Kept beside an imported checkpoint, so an export gives back the keys we do not model.
HF_CONFIG_SIDECAR = "hf_config.json"


class HFError(ValueError):
  """A Hugging Face folder, config or tensor that cannot be mapped; the message names it."""


# --- transforms --------------------------------------------------------------------------
# Each works on numpy/jax arrays and on tracers alike (methods only), so the
# expected Hugging Face shapes come from jax.eval_shape of the export direction.


@dataclasses.dataclass(frozen=True)
class Copy:
  """Same values, same shape (norm scales, embeddings, biases of one axis)."""

  def to_ours(self, x, shape, cfg):
    return x.reshape(shape)

  def to_hf(self, x, cfg):
    return x


@dataclasses.dataclass(frozen=True)
class Reshape:
  """Flat Hugging Face layout -> our named axes; `in_ndim` of ours form its leading axis.

  GPT-2's Conv1D weights are already [in, out]; `in_ndim=None` flattens to one axis (biases).
  """

  in_ndim: int | None = None

  def to_ours(self, x, shape, cfg):
    return x.reshape(shape)

  def to_hf(self, x, cfg):
    if self.in_ndim is None:
      return x.reshape(-1)
    return x.reshape(math.prod(x.shape[: self.in_ndim]), -1)


@dataclasses.dataclass(frozen=True)
class Linear:
  """torch.nn.Linear weight [out, in] <-> our kernel [*in, *out] (`in_ndim` leading axes).

  `scale(cfg)` multiplies on import and divides on export: the query kernel
  carries 1/sqrt(head_dim) in MaxText's numerics (see DESIGN.md).
  """

  in_ndim: int = 1
  scale: Callable[[Config], float | None] = lambda cfg: None

  def to_ours(self, x, shape, cfg):
    kernel = x.T.reshape(shape)
    factor = self.scale(cfg)
    return kernel if factor is None else kernel * factor

  def to_hf(self, x, cfg):
    factor = self.scale(cfg)
    if factor is not None:
      x = x / factor
    return x.reshape(math.prod(x.shape[: self.in_ndim]), -1).T


def _query_scale(cfg: Config) -> float | None:
  # Where the kernel cannot carry the factor, attention applies it at run time instead.
  return cfg.head_dim**-0.5 if initializers.query_kernel_carries_scale(cfg) else None


@dataclasses.dataclass(frozen=True)
class Rule:
  hf: str
  ours: str
  transform: Any = Copy()


# --- the tables --------------------------------------------------------------------------

_LLAMA_ATTENTION = (
    Rule(
        "model.layers.{layer}.self_attn.q_proj.weight", "{layer}/self_attention/query/kernel", Linear(scale=_query_scale)
    ),
    Rule("model.layers.{layer}.self_attn.k_proj.weight", "{layer}/self_attention/key/kernel", Linear()),
    Rule("model.layers.{layer}.self_attn.v_proj.weight", "{layer}/self_attention/value/kernel", Linear()),
    Rule("model.layers.{layer}.self_attn.o_proj.weight", "{layer}/self_attention/out/kernel", Linear(in_ndim=2)),
    Rule("model.layers.{layer}.self_attn.q_norm.weight", "{layer}/self_attention/query_norm/scale"),
    Rule("model.layers.{layer}.self_attn.k_norm.weight", "{layer}/self_attention/key_norm/scale"),
)
_LLAMA_COMMON = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding"),
    Rule("model.norm.weight", "decoder/decoder_norm/scale"),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
    Rule("model.layers.{layer}.input_layernorm.weight", "{layer}/pre_self_attention_layer_norm/scale"),
    Rule("model.layers.{layer}.post_attention_layernorm.weight", "{layer}/post_self_attention_layer_norm/scale"),
)
_GATED_MLP = (
    Rule("model.layers.{layer}.mlp.gate_proj.weight", "{layer}/mlp/wi_0/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.up_proj.weight", "{layer}/mlp/wi_1/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.down_proj.weight", "{layer}/mlp/wo/kernel", Linear()),
)
LLAMA_RULES = _LLAMA_COMMON + _LLAMA_ATTENTION + _GATED_MLP
# Routed experts: one Hugging Face tensor per expert, stacked on axis 0 of ours.
MIXTRAL_RULES = (
    _LLAMA_COMMON
    + _LLAMA_ATTENTION
    + (
        Rule("model.layers.{layer}.block_sparse_moe.gate.weight", "{layer}/MoeBlock_0/gate/kernel", Linear()),
        Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight", "{layer}/MoeBlock_0/wi_0", Linear()),
        Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight", "{layer}/MoeBlock_0/wi_1", Linear()),
        Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight", "{layer}/MoeBlock_0/wo", Linear()),
    )
)


_MLA = "{layer}/self_attention"
_DEEPSEEK_MOE = "{layer}/DeepSeekMoeBlock_0"
DEEPSEEK_RULES = (
    _LLAMA_COMMON
    + _GATED_MLP
    + (
        Rule("model.layers.{layer}.self_attn.q_proj.weight", f"{_MLA}/query/kernel", Linear(scale=_query_scale)),
        Rule("model.layers.{layer}.self_attn.q_a_proj.weight", f"{_MLA}/wq_a/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.q_a_layernorm.weight", f"{_MLA}/q_norm/scale"),
        Rule("model.layers.{layer}.self_attn.q_b_proj.weight", f"{_MLA}/wq_b/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", f"{_MLA}/wkv_a/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.kv_a_layernorm.weight", f"{_MLA}/kv_norm/scale"),
        Rule("model.layers.{layer}.self_attn.kv_b_proj.weight", f"{_MLA}/wkv_b/kernel", Linear()),
        Rule("model.layers.{layer}.self_attn.o_proj.weight", f"{_MLA}/out/kernel", Linear(in_ndim=2)),
        # MoE layers (the dense ones use _GATED_MLP's `mlp`).
        Rule("model.layers.{layer}.mlp.gate.weight", f"{_DEEPSEEK_MOE}/MoeBlock_0/gate/kernel", Linear()),
        Rule("model.layers.{layer}.mlp.gate.e_score_correction_bias", f"{_DEEPSEEK_MOE}/MoeBlock_0/gate/bias"),
        Rule("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", f"{_DEEPSEEK_MOE}/MoeBlock_0/wi_0", Linear()),
        Rule("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", f"{_DEEPSEEK_MOE}/MoeBlock_0/wi_1", Linear()),
        Rule("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", f"{_DEEPSEEK_MOE}/MoeBlock_0/wo", Linear()),
        Rule(
            "model.layers.{layer}.mlp.shared_experts.gate_proj.weight",
            f"{_DEEPSEEK_MOE}/shared_experts/wi_0/kernel",
            Linear(),
        ),
        Rule(
            "model.layers.{layer}.mlp.shared_experts.up_proj.weight",
            f"{_DEEPSEEK_MOE}/shared_experts/wi_1/kernel",
            Linear(),
        ),
        Rule(
            "model.layers.{layer}.mlp.shared_experts.down_proj.weight",
            f"{_DEEPSEEK_MOE}/shared_experts/wo/kernel",
            Linear(),
        ),
    )
)

_GPT2_RULES = (
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


def _gpt2_name(name: str) -> str:
  # The original GPT-2 checkpoints name tensors without the "transformer." prefix.
  return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"


@dataclasses.dataclass(frozen=True)
class Family:
  """How one Hugging Face architecture maps onto one `decoder_block`."""

  model_type: str  # Hugging Face's config.json "model_type"
  architecture: str  # the *ForCausalLM class transformers builds
  decoder_blocks: tuple[str, ...]  # ours, exported as this family
  rules: tuple[Rule, ...]
  config_from_hf: Callable[[Mapping[str, Any]], dict[str, Any]]
  config_to_hf: Callable[[Config], dict[str, Any]]
  # Hugging Face name -> the spelling the rules use (older checkpoints differ).
  normalize_name: Callable[[str], str] = lambda name: name
  # Tensors that carry nothing (saved causal-mask buffers): skipped on import.
  ignored: tuple[str, ...] = ()


def _get(hf: Mapping[str, Any], key: str, default: Any = ..., *, where: str = CONFIG_FILE) -> Any:
  if key in hf and hf[key] is not None:
    return hf[key]
  if default is ...:
    raise HFError(f"{where} has no {key!r}, which the model needs")
  return default


def _int(hf: Mapping[str, Any], key: str, default: Any = ...) -> int:
  """An integer field; a string, float or bool there is an error naming the field, not a guess."""
  value = _get(hf, key, default)
  if isinstance(value, bool) or not isinstance(value, int):
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be an integer")
  return value


def _float(hf: Mapping[str, Any], key: str, default: Any = ...) -> float:
  value = _get(hf, key, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be a number")
  return float(value)


def _bool(hf: Mapping[str, Any], key: str, default: bool) -> bool:
  """A JSON true/false; the string "false" must not read as true."""
  value = _get(hf, key, default)
  if not isinstance(value, bool):
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be true or false")
  return value


def _head_dim(hf: Mapping[str, Any], width_key: str, heads_key: str) -> int:
  """head_dim when given, else width / heads, which must divide exactly."""
  width, heads = _int(hf, width_key), _int(hf, heads_key)
  if hf.get("head_dim") is not None:
    return _int(hf, "head_dim")
  if heads <= 0 or width % heads:
    raise HFError(
        f"{CONFIG_FILE}: {width_key}={width} is not a multiple of {heads_key}={heads}, and no head_dim is given"
    )
  return width // heads


def _require(hf: Mapping[str, Any], key: str, supported: Any, default: Any) -> None:
  value = hf.get(key, default)
  if value is None:
    value = default
  if value != supported:
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} is not supported; maxbridge models {key}={supported!r}")


# Hugging Face's Llama 3.1 scaling parameters, by our config keys.
_LLAMA3_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
}


def _rope_from_hf(hf: Mapping[str, Any], *, llama3: bool) -> dict[str, Any]:
  """RoPE keys from transformers 5's rope_parameters or the older rope_scaling and top-level rope_theta.

  Default RoPE everywhere; Llama 3.1's scaling (rope_type "llama3") where `llama3`.
  """
  parameters = hf.get("rope_parameters") or {}
  legacy = hf.get("rope_scaling") or {}
  for key, value in (("rope_parameters", parameters), ("rope_scaling", legacy)):
    if not isinstance(value, Mapping):
      raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be an object")
  merged = {**parameters, **legacy}  # transformers 5 too lets rope_scaling override rope_parameters
  rope_type = merged.get("rope_type") or merged.get("type") or "default"
  supported = ("default", "llama3") if llama3 else ("default",)
  if rope_type not in supported:
    raise HFError(
        f"{CONFIG_FILE}: rope_parameters.rope_type={rope_type!r} is not supported; maxbridge implements "
        f"{' and '.join(map(repr, supported))} here"
    )
  theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta):
    raise HFError(f"{CONFIG_FILE}: rope_theta={theta!r} must be a number")
  if float(theta) != int(theta):
    raise HFError(f"{CONFIG_FILE}: rope_theta={theta!r} must be a whole number (rope_max_timescale)")
  values: dict[str, Any] = {"rope_max_timescale": int(theta), "rope_type": "default"}
  if rope_type == "llama3":
    missing = [name for name in _LLAMA3_KEYS.values() if name not in merged]
    if missing:
      raise HFError(f"{CONFIG_FILE}: rope_type 'llama3' needs {', '.join(missing)} in rope_parameters")
    values.update(rope_type="llama3.1", rope_use_scale=True)
    values.update({ours: merged[theirs] for ours, theirs in _LLAMA3_KEYS.items()})
  return values


def _rope_to_hf(cfg: Config) -> dict[str, Any]:
  theta = float(cfg.rope_max_timescale)
  parameters: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
  if rotary.scaling_from_config(cfg) is not None:
    parameters.update(rope_type="llama3", **{theirs: getattr(cfg, ours) for ours, theirs in _LLAMA3_KEYS.items()})
  # transformers 4 reads rope_scaling and rope_theta; 5 reads rope_parameters
  # but lets rope_scaling override it, so an imported model's stale one must go.
  scaling = dict(parameters) if rotary.scaling_from_config(cfg) is not None else None
  return {"rope_parameters": parameters, "rope_scaling": scaling, "rope_theta": theta}


_LLAMA_BLOCKS = {"llama": "llama2", "mistral": "mistral", "qwen3": "qwen3", "mixtral": "mixtral"}


def _llama_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  _require(hf, "hidden_act", "silu", "silu")
  _require(hf, "attention_bias", False, False)
  _require(hf, "mlp_bias", False, False)
  model_type = hf.get("model_type")
  heads = _int(hf, "num_attention_heads")
  values = {
      "decoder_block": _LLAMA_BLOCKS[model_type],
      "base_emb_dim": _int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": _int(hf, "num_key_value_heads", heads),
      "head_dim": _head_dim(hf, "hidden_size", "num_attention_heads"),
      "base_mlp_dim": _int(hf, "intermediate_size"),
      "base_num_decoder_layers": _int(hf, "num_hidden_layers"),
      "vocab_size": _int(hf, "vocab_size"),
      "normalization_layer_epsilon": _float(hf, "rms_norm_eps", 1e-6),
      **_rope_from_hf(hf, llama3=True),
      "logits_via_embedding": _bool(hf, "tie_word_embeddings", False),
      "use_qk_norm": model_type == "qwen3",
      "sliding_window_size": 0,
  }
  if model_type in ("mistral", "mixtral"):
    values["sliding_window_size"] = _int(hf, "sliding_window", 0)
  if model_type == "mixtral":
    values.update(
        num_experts=_int(hf, "num_local_experts"),
        num_experts_per_tok=_int(hf, "num_experts_per_tok"),
        load_balance_loss_weight=_float(hf, "router_aux_loss_coef", 0.0),
    )
  if model_type == "qwen3" and _bool(hf, "use_sliding_window", False):
    raise HFError(f"{CONFIG_FILE}: use_sliding_window=true (Qwen3's per-layer windows) is not supported")
  return values


def _llama_config_to_hf(cfg: Config) -> dict[str, Any]:
  model_type = {block: hf_type for hf_type, block in _LLAMA_BLOCKS.items()}[cfg.decoder_block]
  if cfg.use_qk_norm != (model_type == "qwen3"):
    raise HFError(f"use_qk_norm={cfg.use_qk_norm} has no Hugging Face {model_type} equivalent")
  if cfg.sliding_window_size and model_type not in ("mistral", "mixtral"):
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
      **_rope_to_hf(cfg),
  }
  if model_type == "llama":
    hf.update(attention_bias=False, mlp_bias=False)
  if model_type in ("mistral", "mixtral"):
    hf["sliding_window"] = cfg.sliding_window_size or None
  if model_type == "mixtral":
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
  if model_type == "qwen3":
    hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
  return hf


def _gpt2_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
    raise HFError(
        f"{CONFIG_FILE}: activation_function={hf.get('activation_function')!r} is not supported; "
        "maxbridge's gpt3 block uses the tanh GELU ('gelu_new')"
    )
  _require(hf, "scale_attn_weights", True, True)
  _require(hf, "scale_attn_by_inverse_layer_idx", False, False)
  _require(hf, "add_cross_attention", False, False)
  width, heads = _int(hf, "n_embd"), _int(hf, "n_head")
  if hf.get("head_dim") is not None:
    raise HFError(f"{CONFIG_FILE}: head_dim is not a GPT-2 field; GPT-2's heads are n_embd / n_head wide")
  positions = _int(hf, "n_positions")
  return {
      "decoder_block": "gpt3",
      "base_emb_dim": width,
      "base_num_query_heads": heads,
      "base_num_kv_heads": heads,
      "head_dim": _head_dim(hf, "n_embd", "n_head"),
      "base_mlp_dim": _int(hf, "n_inner", 4 * width),
      "base_num_decoder_layers": _int(hf, "n_layer"),
      "vocab_size": _int(hf, "vocab_size"),
      "trainable_position_size": positions,
      # The learned table bounds every sequence: no longer than n_positions.
      "max_target_length": positions,
      "normalization_layer_epsilon": _float(hf, "layer_norm_epsilon", 1e-5),
      "logits_via_embedding": _bool(hf, "tie_word_embeddings", True),
  }


def _gpt2_config_to_hf(cfg: Config) -> dict[str, Any]:
  if cfg.head_dim * cfg.num_query_heads != cfg.emb_dim:
    raise HFError(
        f"GPT-2 needs head_dim * heads == emb_dim; got head_dim={cfg.head_dim}, "
        f"base_num_query_heads={cfg.num_query_heads}, base_emb_dim={cfg.emb_dim}"
    )
  return {
      "n_embd": cfg.emb_dim,
      "n_head": cfg.num_query_heads,
      "n_inner": cfg.mlp_dim,
      "n_layer": cfg.num_decoder_layers,
      "vocab_size": cfg.vocab_size,
      "n_positions": cfg.trainable_position_size,
      "layer_norm_epsilon": cfg.normalization_layer_epsilon,
      "activation_function": "gelu_new",
      "scale_attn_weights": True,
      "scale_attn_by_inverse_layer_idx": False,
      "tie_word_embeddings": cfg.logits_via_embedding,
  }


def _deepseek_config_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  _require(hf, "hidden_act", "silu", "silu")
  _require(hf, "attention_bias", False, False)
  _require(hf, "rope_interleave", True, True)
  _require(hf, "norm_topk_prob", True, True)
  _require(hf, "scoring_func", "sigmoid", "sigmoid")  # DeepSeek's own config.json spells these out
  _require(hf, "topk_method", "noaux_tc", "noaux_tc")
  heads = _int(hf, "num_attention_heads")
  nope, rope = _int(hf, "qk_nope_head_dim"), _int(hf, "qk_rope_head_dim")
  return {
      "decoder_block": "deepseek",
      "base_emb_dim": _int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": _int(hf, "num_key_value_heads", heads),
      "head_dim": nope + rope,
      "base_mlp_dim": _int(hf, "intermediate_size"),
      "moe_mlp_dim": _int(hf, "moe_intermediate_size"),
      "base_num_decoder_layers": _int(hf, "num_hidden_layers"),
      "first_num_dense_layers": _int(hf, "first_k_dense_replace", 0),
      "vocab_size": _int(hf, "vocab_size"),
      "normalization_layer_epsilon": _float(hf, "rms_norm_eps", 1e-6),
      **_rope_from_hf(hf, llama3=True),
      "logits_via_embedding": _bool(hf, "tie_word_embeddings", False),
      "num_experts": _int(hf, "n_routed_experts"),
      "num_experts_per_tok": _int(hf, "num_experts_per_tok"),
      "shared_experts": _int(hf, "n_shared_experts", 0),
      "n_routing_groups": _int(hf, "n_group", 1),
      "topk_routing_group": _int(hf, "topk_group", 1),
      "routed_scaling_factor": _float(hf, "routed_scaling_factor", 1.0),
      "routed_score_func": "sigmoid",
      "routed_bias": True,
      "load_balance_loss_weight": 0.0,
      "q_lora_rank": _int(hf, "q_lora_rank", 0),
      "kv_lora_rank": _int(hf, "kv_lora_rank"),
      "qk_nope_head_dim": nope,
      "qk_rope_head_dim": rope,
      "v_head_dim": _int(hf, "v_head_dim"),
  }


def _deepseek_config_to_hf(cfg: Config) -> dict[str, Any]:
  if cfg.routed_score_func != "sigmoid" or not cfg.routed_bias:
    raise HFError(
        "DeepSeek-V3 routes by sigmoid scores with a correction bias: routed_score_func='sigmoid' "
        "and routed_bias=true are needed for an export"
    )
  return {
      "hidden_size": cfg.emb_dim,
      "num_attention_heads": cfg.num_query_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "intermediate_size": cfg.mlp_dim,
      "moe_intermediate_size": cfg.moe_mlp_dim,
      "num_hidden_layers": cfg.num_decoder_layers,
      "first_k_dense_replace": cfg.first_num_dense_layers,
      "vocab_size": cfg.vocab_size,
      "rms_norm_eps": cfg.normalization_layer_epsilon,
      "tie_word_embeddings": cfg.logits_via_embedding,
      "n_routed_experts": cfg.num_experts,
      "num_experts_per_tok": cfg.num_experts_per_tok,
      "n_shared_experts": cfg.shared_experts,
      "n_group": max(cfg.n_routing_groups, 1),
      "topk_group": max(cfg.topk_routing_group, 1),
      "routed_scaling_factor": cfg.routed_scaling_factor,
      "norm_topk_prob": True,
      "q_lora_rank": cfg.q_lora_rank or None,
      "kv_lora_rank": cfg.kv_lora_rank,
      "qk_nope_head_dim": cfg.qk_nope_head_dim,
      "qk_rope_head_dim": cfg.qk_rope_head_dim,
      "head_dim": cfg.qk_rope_head_dim,  # what transformers sizes its rotary tables by
      "v_head_dim": cfg.v_head_dim,
      "rope_interleave": True,
      "hidden_act": "silu",
      "attention_bias": False,
      **_rope_to_hf(cfg),
  }


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", ("llama2",), LLAMA_RULES, _llama_config_from_hf, _llama_config_to_hf),
    Family("mistral", "MistralForCausalLM", ("mistral",), LLAMA_RULES, _llama_config_from_hf, _llama_config_to_hf),
    Family("qwen3", "Qwen3ForCausalLM", ("qwen3",), LLAMA_RULES, _llama_config_from_hf, _llama_config_to_hf),
    Family("mixtral", "MixtralForCausalLM", ("mixtral",), MIXTRAL_RULES, _llama_config_from_hf, _llama_config_to_hf),
    Family(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        ("deepseek",),
        DEEPSEEK_RULES,
        _deepseek_config_from_hf,
        _deepseek_config_to_hf,
    ),
    Family(
        "gpt2",
        "GPT2LMHeadModel",
        ("gpt3",),
        _GPT2_RULES,
        _gpt2_config_from_hf,
        _gpt2_config_to_hf,
        normalize_name=_gpt2_name,
        ignored=(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",),
    ),
)


def family_for_model_type(model_type: str | None) -> Family:
  for family in FAMILIES:
    if family.model_type == model_type:
      return family
  known = ", ".join(f.model_type for f in FAMILIES)
  raise HFError(f"{CONFIG_FILE}: model_type={model_type!r} is not supported; supported: {known}")


def family_for_config(cfg: Config) -> Family:
  for family in FAMILIES:
    if cfg.decoder_block in family.decoder_blocks:
      return family
  raise HFError(f"decoder_block={cfg.decoder_block!r} has no Hugging Face export")
