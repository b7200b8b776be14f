"""Qwen3.5 ("qwen3_5"), dense and MoE: Qwen3-Next's hybrid of gated DeltaNet and gated attention layers.

MaxText's `qwen3_5` decoder block: one block for both sizes of model, dense
where `num_experts` is 1 (each layer then ends in one SwiGLU `mlp`,
`base_mlp_dim` wide), else Qwen3-Next's routed experts plus the
sigmoid-gated shared expert. Everything else is Qwen3-Next's, layer for
layer and parameter for parameter (`maxbridge.core.families.qwen3_next`, whose
layer classes both backends run): blocks of three DeltaNet layers then one
full-attention layer, the zero-centred norms, the attention's output gate and
partial RoPE, the DeltaNet decode state.

Hugging Face. transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM
differ from Qwen3-Next in how they store the DeltaNet's input projections:
in_proj_qkv (every query head, then every key head, then every value head) and
in_proj_z, in_proj_b, in_proj_a apart, where the canonical tree (as MaxText's
Qwen3.5, which runs Qwen3-Next's GatedDeltaNet) keeps Qwen3-Next's
in_proj_qkvz and in_proj_ba, each key head's columns together: the import
joins them (`Piece`) and the export cuts them apart again. The MoE's experts,
router and shared expert are named as Qwen3-Next's. A
Qwen3_5(Moe)ForConditionalGeneration folder (model_type qwen3_5 / qwen3_5_moe)
is read as its language model (`text_config`, the tensors under
model.language_model.), its vision tower and its MTP layer left out as
transformers' Qwen3_5ForCausalLM leaves them (`_keys_to_ignore_on_load_unexpected`);
it exports as the *ForCausalLM text model.

Positions. Qwen3.5 rotates by multimodal RoPE (`mrope_section`,
`mrope_interleaved`): for text every one of its three position streams is the
token's position, and then it is the ordinary RoPE of the first
`partial_rotary_factor` of each head.
"""

from __future__ import annotations

from typing import Any, Mapping

from maxbridge.core.families import qwen3_moe, qwen3_next
from maxbridge.core.families.base import RECURRENT_MIXER, Config, Family, Stack, broken, key_value_cache
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Piece,
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

_LINEAR = "model.layers.{layer}.linear_attn"
_QKVZ = f"{{layer}}/{RECURRENT_MIXER}/in_proj_qkvz/kernel"
_BA = f"{{layer}}/{RECURRENT_MIXER}/in_proj_ba/kernel"


def _qkvz_widths(config: Config) -> tuple[int, int]:
  """Per key head, in_proj_qkvz's columns from in_proj_qkv (its query, key, values), then from in_proj_z (gates)."""
  values = qwen3_next.value_groups(config) * config.gdn_value_head_dim
  return 2 * config.gdn_key_head_dim + values, values


def _ba_widths(config: Config) -> tuple[int, int]:
  """Per key head, in_proj_ba's columns from in_proj_b, then from in_proj_a: one per value head."""
  return qwen3_next.value_groups(config), qwen3_next.value_groups(config)


def _grouped_columns(config: Config) -> list[int]:
  """in_proj_qkv's output rows [every query, every key, every value] in key-head order: each key head's query,
  key and its value heads' values."""
  heads, key, groups = config.gdn_num_key_heads, config.gdn_key_head_dim, qwen3_next.value_groups(config)
  values = groups * config.gdn_value_head_dim
  order = []
  for head in range(heads):
    order += range(head * key, (head + 1) * key)
    order += range((heads + head) * key, (heads + head + 1) * key)
    order += range(2 * heads * key + head * values, 2 * heads * key + (head + 1) * values)
  return order


class GroupedQKV:
  """in_proj_qkv's weight [Hk K + Hk K + Hv V, D] <-> our kernel [D, Hk, 2K + gV], each key head's rows together."""

  def to_ours(self, x, shape, config):
    return x[(_grouped_columns(config),)].T.reshape(shape)

  def to_hf(self, x, config):
    order = _grouped_columns(config)
    back = [0] * len(order)
    for position, row in enumerate(order):
      back[row] = position
    return x.reshape(x.shape[0], -1).T[(back,)]


_DELTANET_INPUTS = (
    Rule(f"{_LINEAR}.in_proj_qkv.weight", _QKVZ, Piece(0, _qkvz_widths, GroupedQKV())),
    Rule(f"{_LINEAR}.in_proj_z.weight", _QKVZ, Piece(1, _qkvz_widths)),
    Rule(f"{_LINEAR}.in_proj_b.weight", _BA, Piece(0, _ba_widths)),
    Rule(f"{_LINEAR}.in_proj_a.weight", _BA, Piece(1, _ba_widths)),
)
# Qwen3-Next's rules but its fused DeltaNet inputs and its MoE (the last of its rules that name "mlp").
_SHARED = tuple(
    rule
    for rule in qwen3_next.RULES
    if not rule.ours.endswith(("in_proj_qkvz/kernel", "in_proj_ba/kernel")) and ".mlp." not in rule.hf
)
_MOE = tuple(rule for rule in qwen3_next.RULES if ".mlp." in rule.hf)
_DENSE_MLP = (
    Rule("model.layers.{layer}.mlp.gate_proj.weight", "{layer}/mlp/wi_0/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.up_proj.weight", "{layer}/mlp/wi_1/kernel", Linear()),
    Rule("model.layers.{layer}.mlp.down_proj.weight", "{layer}/mlp/wo/kernel", Linear()),
)
DENSE_RULES = _SHARED + _DELTANET_INPUTS + _DENSE_MLP
MOE_RULES = _SHARED + _DELTANET_INPUTS + _MOE

_COMMON_DEFAULTS = {
    "vocab_size": 248320,
    "num_attention_heads": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "layer_types": None,
}
# transformers' class defaults of what its model reads (tests compare them with transformers').
DENSE_CONFIG = ConfigClass(
    "Qwen3_5TextConfig",
    {
        **_COMMON_DEFAULTS,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_key_value_heads": 4,
    },
)
MOE_CONFIG = ConfigClass(
    "Qwen3_5MoeTextConfig",
    {
        **_COMMON_DEFAULTS,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 8,
        "num_experts": 256,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
)
# Qwen3_5TextConfig's partial_rotary_factor when its RoPE parameters give none.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25


def _hybrid_from_hf(hf: Mapping[str, Any], config_class: ConfigClass) -> dict[str, Any]:
  """What the dense and the MoE text configs spell alike: sizes, RoPE, attention and the DeltaNet."""
  require_one_of(hf, "hidden_act", ("silu", "swish"))
  require(hf, "attention_bias", False, False)
  layers = get_int(hf, "num_hidden_layers")
  kinds = hf["layer_types"] or qwen3_next.layer_kinds(layers)  # the class's default: full_attention_interval 4
  if list(kinds) != qwen3_next.layer_kinds(layers):
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} with layer_types={kinds!r} is not supported; maxbridge's "
        f"qwen3_5 stacks blocks of {qwen3_next.PATTERN - 1} linear_attention layers then a full_attention one"
    )
  heads = get_int(hf, "num_attention_heads")
  return {
      "decoder_block": "qwen3_5",
      "base_emb_dim": get_int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
      "head_dim": head_dim(hf, "hidden_size", "num_attention_heads"),
      "base_num_decoder_layers": layers,
      "vocab_size": get_int(hf, "vocab_size"),
      "normalization_layer_epsilon": get_float(hf, "rms_norm_eps"),
      # mrope_section / mrope_interleaved: text positions are equal in all three streams (the module docstring).
      **rope_from_hf(
          hf, llama3=False, default_theta=config_class.default_theta, partial_rotary_default=DEFAULT_PARTIAL_ROTARY_FACTOR
      ),
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
      "use_qk_norm": True,
      **qwen3_next.deltanet_from_hf(hf),
  }


def _dense_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = DENSE_CONFIG.read(raw)
  return {**_hybrid_from_hf(hf, DENSE_CONFIG), "base_mlp_dim": get_int(hf, "intermediate_size"), "num_experts": 1}


def _moe_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = MOE_CONFIG.read(raw)
  routed = get_int(hf, "moe_intermediate_size")
  shared = get_int(hf, "shared_expert_intermediate_size")
  if shared <= 0 or shared % routed:
    raise HFError(
        f"{CONFIG_FILE}: shared_expert_intermediate_size={shared} must be a positive multiple of "
        f"moe_intermediate_size={routed} (maxbridge's shared_experts counts routed experts' widths)"
    )
  aux = get_float(hf, "router_aux_loss_coef") if get_bool(hf, "output_router_logits") else 0.0
  return {
      **_hybrid_from_hf(hf, MOE_CONFIG),
      "base_mlp_dim": routed,  # read by no layer (every layer routes), as MaxText's qwen3.5 models set it
      "num_experts": get_int(hf, "num_experts"),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "moe_mlp_dim": routed,
      "shared_experts": shared // routed,
      # Qwen3_5MoeTopKRouter always rescales the top k weights to sum to 1 (the class has no norm_topk_prob).
      "routed_score_func": "softmax",
      "norm_topk_prob": True,
      "load_balance_loss_weight": aux,
  }


def _text_config(raw: Mapping[str, Any], text_type: str) -> dict[str, Any]:
  """A *ForConditionalGeneration config.json's language model: its text_config."""
  text = raw.get("text_config")
  if not isinstance(text, Mapping):
    raise HFError(f"{CONFIG_FILE}: model_type={raw.get('model_type')!r} has no text_config object to read")
  if text.get("model_type", text_type) != text_type:
    raise HFError(f"{CONFIG_FILE}: text_config.model_type={text['model_type']!r}; expected {text_type!r}")
  # The outer model ties its head (its own tie_word_embeddings, false by default), not the text config's.
  return {**text, "tie_word_embeddings": raw.get("tie_word_embeddings", False)}


def _hybrid_to_hf(config: Config) -> dict[str, Any]:
  rope = rope_to_hf(config)
  rope["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
  hf = {
      **common_to_hf(config),
      "layer_types": qwen3_next.layer_kinds(config.num_decoder_layers),
      "hidden_act": "silu",
      **rope,
      "attention_bias": False,
      **qwen3_next.deltanet_to_hf(config),
  }
  hf.pop("rope_theta", None)
  return hf


def _dense_to_hf(config: Config) -> dict[str, Any]:
  return _hybrid_to_hf(config)


def _moe_to_hf(config: Config) -> dict[str, Any]:
  qwen3_moe.check_unscaled_softmax(config, "Qwen3.5-MoE")
  if not (config.norm_topk_prob or config.routed_score_func == ""):
    raise HFError(
        "Qwen3.5-MoE rescales each token's top k routing weights to sum to 1: norm_topk_prob=true (or "
        "routed_score_func='') is needed for an export"
    )
  hf = _hybrid_to_hf(config)
  del hf["intermediate_size"]  # Qwen3_5MoeTextConfig has none
  hf.update(
      num_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      moe_intermediate_size=config.moe_mlp_dim,
      shared_expert_intermediate_size=config.shared_experts * config.moe_mlp_dim,
      output_router_logits=config.load_balance_loss_weight > 0,
  )
  if config.load_balance_loss_weight > 0:  # else an imported config's coefficient is kept, and unused
    hf["router_aux_loss_coef"] = config.load_balance_loss_weight
  return hf


def _from_multimodal(name: str) -> str:
  """A *ForConditionalGeneration tensor name as the text model's: model.language_model.X is model.X."""
  return "model." + name.removeprefix("model.language_model.") if name.startswith("model.language_model.") else name


# What transformers' Qwen3_5ForCausalLM drops from a checkpoint (`_keys_to_ignore_on_load_unexpected`).
_IGNORED = (r"mtp\..*", r"model\.visual\..*")


def _is_dense(config: Config) -> bool:
  return not qwen3_next.routes(config)


HF_FAMILIES = (
    HFFamily(
        "qwen3_5_text",
        "Qwen3_5ForCausalLM",
        ("qwen3_5",),
        DENSE_RULES,
        _dense_from_hf,
        _dense_to_hf,
        DENSE_CONFIG,
        normalize_name=_from_multimodal,
        ignored=_IGNORED,
        exports=_is_dense,
    ),
    HFFamily(
        "qwen3_5_moe_text",
        "Qwen3_5MoeForCausalLM",
        ("qwen3_5",),
        MOE_RULES,
        _moe_from_hf,
        _moe_to_hf,
        MOE_CONFIG,
        normalize_name=_from_multimodal,
        ignored=_IGNORED,
        exports=qwen3_next.routes,
    ),
    # Read only (their language model): an export writes the text model above. A folder's tensors are read by the
    # family it exports as (`family_for_config`), so the text families read this layout too.
    HFFamily(
        "qwen3_5",
        "Qwen3_5ForConditionalGeneration",
        ("qwen3_5",),
        DENSE_RULES,
        lambda raw: _dense_from_hf(_text_config(raw, "qwen3_5_text")),
        _dense_to_hf,
        DENSE_CONFIG,
        normalize_name=_from_multimodal,
        ignored=_IGNORED,
        exports=lambda config: False,
    ),
    HFFamily(
        "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
        ("qwen3_5",),
        MOE_RULES,
        lambda raw: _moe_from_hf(_text_config(raw, "qwen3_5_moe_text")),
        _moe_to_hf,
        MOE_CONFIG,
        normalize_name=_from_multimodal,
        ignored=_IGNORED,
        exports=lambda config: False,
    ),
)


def _check(config: Config) -> list[str]:
  if qwen3_next.routes(config):
    return qwen3_next.hybrid_rules(config) + qwen3_next.expert_rules(config)
  dense = None
  if config.num_experts != 1:
    dense = f"decoder_block='qwen3_5' is dense with num_experts=1, else routes to >= 2: num_experts={config.num_experts}"
  return qwen3_next.hybrid_rules(config) + broken(dense)


FAMILY = Family(
    decoder_blocks=("qwen3_5",),
    stacks=(
        Stack(
            "layers",
            "qwen3_next",  # Qwen3-Next's block classes, on both backends
            depth=lambda config: config.num_decoder_layers // qwen3_next.PATTERN,
            sublayers=qwen3_next.SUBLAYERS,
            recurrent=tuple(sub for sub in qwen3_next.SUBLAYERS if qwen3_next.is_linear(sub)),
        ),
    ),
    attention=qwen3_next.attention,
    norm="zero_centred_rms_norm",
    query_kernel_carries_scale=False,  # the QK-norm would undo it
    cache_entries=key_value_cache,
    qk_clip_targets=qwen3_next.no_clip_targets,
    hf=HF_FAMILIES,
    check=_check,
    ring_cache=False,
    recurrent_state=qwen3_next.deltanet_state,
    own_keys=qwen3_next.OWN_KEYS,
)
