"""Gemma 3 ("gemma3", text only): Gemma 2's layers with QK-norm, five sliding-window layers to one global.

Parameters follow MaxText's Gemma checkpoints as Gemma 1 and 2 do (`gemma`):
the token table holds sqrt(emb_dim) x Hugging Face's, norm scales (the query
and key norms too) hold Hugging Face's (1 + w). The query/key norms would undo
a scale folded into the query kernel, so attention scales queries by
query_pre_attn_scalar ** -0.5 at run time.

As MaxText's Gemma3ScannableBlock, the decoder stacks blocks of six layers
(`SUBLAYERS`: five sliding-window ones, then a global one) and scans them; the
layers past the last whole block (26 = 4 x 6 + 2 in gemma3-1b) all come before
a global layer, so they are sliding-window layers of one kind, stacked and
scanned on their own (`layers_remainder`). `base_num_decoder_layers` counts
layers, as in MaxText. Local and global layers turn at their own RoPE theta,
and only the global ones take the linear scaling (`ops.rotary.layer_rope`).

The names are not MaxText's, whose gemma3 checkpoints therefore do not load as
they are. MaxText names a block's layers `layers_0`..`layers_5`
(`decoder/layers/layers_0/...`), which the canonical grammar reads as unscanned
layer 0 of stack `layers`; it keeps the remainder as one unscanned block
(`decoder/layers_remainder/layers_<j>/...`, no layer axis) where a canonical
stack is scanned; and its unscanned gemma3 is a flat `layers_0`..`layers_<N-1>`,
a regrouping of its scanned tree, not the unstacking the canonical tree assumes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxbridge.core.families.base import Config, Family, Stack, broken, key_value_cache, query_kernel_clip
from maxbridge.core.families.gemma import (
    attention,
    GEMMA2_CONFIG,
    GEMMA2_RULES,
    MAXTEXT_GEMMA2,
    PlusOne,
    gemma_common_to_hf,
    read_common,
    soft_cap,
    query_pre_attn_scalar,
)
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    ConfigClass,
    Copy,
    HFError,
    HFFamily,
    Linear,
    Reshape,
    Rule,
    get,
    get_bool,
    get_float,
    get_int,
)

SUBLAYERS = ("local_0", "local_1", "local_2", "local_3", "local_4", "global")  # a block's layers, in depth order
GLOBAL = "global"  # the one that attends in full
PATTERN = len(SUBLAYERS)
_LOCAL_KIND, _GLOBAL_KIND = "sliding_attention", "full_attention"  # Hugging Face's layer_types

_QUERY = "model.layers.{layer}.self_attn.q_proj.weight"
RULES = (
    # No query scale in the kernel: the QK-norm would undo it (attention scales at run time).
    Rule(_QUERY, "{layer}/self_attention/query/kernel", Linear()),
    *(rule for rule in GEMMA2_RULES if rule.hf != _QUERY),
    Rule("model.layers.{layer}.self_attn.q_norm.weight", "{layer}/self_attention/query_norm/scale", PlusOne()),
    Rule("model.layers.{layer}.self_attn.k_norm.weight", "{layer}/self_attention/key_norm/scale", PlusOne()),
)

CONFIG_CLASS = ConfigClass(
    "Gemma3TextConfig",
    {
        **GEMMA2_CONFIG.defaults,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
    default_theta={"global": 1_000_000.0, "local": 10_000.0},  # transformers': one per layer kind
)
_THETAS = {_LOCAL_KIND: CONFIG_CLASS.default_theta["local"], _GLOBAL_KIND: CONFIG_CLASS.default_theta["global"]}


def layer_kinds(layers: int) -> list[str]:
  """Hugging Face's layer_types of `layers` layers: every sixth one global."""
  return [_GLOBAL_KIND if (i + 1) % PATTERN == 0 else _LOCAL_KIND for i in range(layers)]


def _theta(value: Any, field: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value) or value <= 0:
    raise HFError(f"{CONFIG_FILE}: {field}={value!r} must be a positive whole number (a RoPE theta)")
  return int(value)


def _rope(raw: Mapping[str, Any]) -> dict[str, Any]:
  """Our per-layer RoPE keys, read as Gemma3TextConfig builds each layer kind's RoPE.

  `rope_parameters` maps each kind to its own; a legacy `rope_scaling` updates
  the full_attention one, and the legacy `rope_theta` / `rope_local_base_freq`
  fill in the full_attention / sliding_attention theta where it lacks one
  (else the class's 1e6 / 1e4). Keys of a flat `rope_parameters` are not read.
  """
  parameters = raw.get("rope_parameters") or {}
  if not isinstance(parameters, Mapping):
    raise HFError(f"{CONFIG_FILE}: rope_parameters={parameters!r} must be an object")
  per_kind = {kind: dict(parameters.get(kind) or {"rope_type": "default"}) for kind in _THETAS}
  per_kind[_GLOBAL_KIND].update(raw.get("rope_scaling") or {})
  legacy = {_GLOBAL_KIND: "rope_theta", _LOCAL_KIND: "rope_local_base_freq"}
  for kind, own in per_kind.items():
    own.setdefault("rope_theta", raw.get(legacy[kind], _THETAS[kind]))
  local, full = per_kind[_LOCAL_KIND], per_kind[_GLOBAL_KIND]
  for kind, supported in ((_LOCAL_KIND, ("default",)), (_GLOBAL_KIND, ("default", "linear"))):
    own = per_kind[kind]
    rope_type = own.get("rope_type", own.get("type", "default"))
    if rope_type not in supported:
      raise HFError(
          f"{CONFIG_FILE}: rope_parameters.{kind} (with rope_scaling for full_attention) has rope_type="
          f"{rope_type!r}; maxbridge's gemma3 implements {' and '.join(map(repr, supported))} there"
      )
    if own.get("partial_rotary_factor", 1.0) != 1.0:
      raise HFError(f"{CONFIG_FILE}: rope_parameters.{kind}.partial_rotary_factor is not supported (whole heads)")
  factor = 1.0
  if full.get("rope_type", full.get("type")) == "linear":
    factor = get_float(full, "factor")
    if factor <= 0:
      raise HFError(f"{CONFIG_FILE}: rope_parameters.full_attention.factor={factor!r} must be > 0")
  return {
      "rope_type": "default",
      "rope_max_timescale": _theta(full["rope_theta"], "rope_parameters.full_attention.rope_theta"),
      "local_rope_max_timescale": _theta(local["rope_theta"], "rope_parameters.sliding_attention.rope_theta"),
      "rope_linear_scaling_factor": factor,
  }


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  layers = get_int(hf, "num_hidden_layers")
  kinds = hf["layer_types"]
  if kinds is None:  # Gemma3TextConfig's __post_init__, from the legacy sliding_window_pattern (6)
    pattern = get_int(hf, "sliding_window_pattern", PATTERN)
    kinds = [_GLOBAL_KIND if (i + 1) % pattern == 0 else _LOCAL_KIND for i in range(layers)]
  if list(kinds) != layer_kinds(layers):
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} with layer_types={kinds!r} (or sliding_window_pattern) is not "
        f"supported; maxbridge's gemma3 stacks blocks of {PATTERN - 1} sliding_attention layers then a "
        "full_attention one"
    )
  window = get(hf, "sliding_window", None)
  if window is None or get_int(hf, "sliding_window") <= 0:
    raise HFError(f"{CONFIG_FILE}: sliding_window={window!r} must be a positive integer")
  scalar = get_int(hf, "query_pre_attn_scalar")
  if scalar <= 0:
    raise HFError(f"{CONFIG_FILE}: query_pre_attn_scalar={scalar!r} must be > 0")
  # The common reader reads one flat RoPE: give it the global one, then set both kinds' own.
  flat = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": None}
  return {
      **read_common(flat, "gemma3", "hidden_activation"),
      **_rope(raw),
      "base_num_decoder_layers": layers,
      "use_qk_norm": True,
      "sliding_window_size": window,
      # transformers' Gemma3Attention never applies attn_logit_softcapping (a field Gemma 3 keeps unused).
      "attn_logits_soft_cap": 0.0,
      "final_logits_soft_cap": soft_cap(hf, "final_logit_softcapping"),
      "query_pre_attn_scalar": scalar,
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  if config.attn_logits_soft_cap:
    raise HFError(
        f"attn_logits_soft_cap={config.attn_logits_soft_cap} has no Hugging Face gemma3_text equivalent: transformers' "
        "Gemma3Attention never applies attn_logit_softcapping; export with attn_logits_soft_cap=0"
    )
  global_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_max_timescale)}
  if config.rope_linear_scaling_factor != 1.0:
    global_rope.update(rope_type="linear", factor=config.rope_linear_scaling_factor)
  local_theta = config.local_rope_max_timescale if config.local_rope_max_timescale > 0 else config.rope_max_timescale
  values = {
      **gemma_common_to_hf(config, config.num_decoder_layers),
      "hidden_activation": "gelu_pytorch_tanh",
      "sliding_window": config.sliding_window_size,
      "layer_types": layer_kinds(config.num_decoder_layers),
      "query_pre_attn_scalar": query_pre_attn_scalar(config),
      "attn_logit_softcapping": None,
      "final_logit_softcapping": config.final_logits_soft_cap or None,
      "use_bidirectional_attention": False,
      "rope_parameters": {
          _LOCAL_KIND: {"rope_type": "default", "rope_theta": float(local_theta)},
          _GLOBAL_KIND: global_rope,
      },
      "rope_scaling": None,
  }
  values.pop("rope_theta", None)
  return values


def _check(config: Config) -> list[str]:
  norm = window = rope = None
  if not config.use_qk_norm:
    norm = "decoder_block='gemma3' normalises each head's queries and keys: set use_qk_norm=true"
  if not config.sliding_window_size:
    window = f"decoder_block='gemma3' gives {PATTERN - 1} of every {PATTERN} layers a sliding window: set sliding_window_size > 0"
  if config.rope_type != "default":
    rope = (
        f"rope_type={config.rope_type!r} with decoder_block='gemma3': its global layers scale RoPE linearly "
        "(rope_linear_scaling_factor); set rope_type='default'"
    )
  return broken(norm, window, rope)


def _remainder(config: Config) -> int:
  return config.num_decoder_layers % PATTERN


# --- Gemma3ForConditionalGeneration: the same language model under model.language_model, SigLIP and the projector ---

# The names transformers 5 saves (and the Hub's checkpoints hold); `_normalized_name` reads its in-memory ones too.
_TEXT_PREFIX, _MULTIMODAL_TEXT_PREFIX = "model.", "language_model.model."
_TEXT_HEAD, _MULTIMODAL_HEAD = "lm_head.weight", "language_model.lm_head.weight"
_TOWER, _PROJECTOR = "vision_tower.", "multi_modal_projector."
_VISION_LAYER = "{vision_layer}"  # a tower block's index: `maxbridge.interop.hf.mapping` expands it
_SPELLINGS = (  # (another spelling's prefix, ours), the first that matches
    ("model.language_model.", _MULTIMODAL_TEXT_PREFIX),
    ("model.vision_tower.vision_model.", _TOWER),
    ("model.vision_tower.", _TOWER),
    ("vision_tower.vision_model.", _TOWER),
    ("model.multi_modal_projector.", _PROJECTOR),
    (_TEXT_HEAD, _MULTIMODAL_HEAD),
)


def _normalized_name(name: str) -> str:
  for theirs, ours in _SPELLINGS:
    if name.startswith(theirs):
      return ours + name.removeprefix(theirs)
  return name


@dataclasses.dataclass(frozen=True)
class ConvKernel:
  """torch.nn.Conv2d weight [out, in, h, w] <-> our patch embedding's kernel [h, w, in, out] (a matmul's)."""

  def to_ours(self, x, shape, config):
    return x.transpose(2, 3, 1, 0).reshape(shape)

  def to_hf(self, x, config):
    return x.transpose(3, 2, 0, 1)


def _multimodal_text_name(name: str) -> str:
  if name == _TEXT_HEAD:
    return _MULTIMODAL_HEAD
  return _MULTIMODAL_TEXT_PREFIX + name.removeprefix(_TEXT_PREFIX)


_BLOCK = f"vision_encoder/encoderblock_{_VISION_LAYER}"
_HF_BLOCK = _TOWER + "encoder.layers.{layer}."
VISION_RULES = (
    Rule(_TOWER + "embeddings.patch_embedding.weight", "vision_encoder/embedding/kernel", ConvKernel()),
    Rule(_TOWER + "embeddings.patch_embedding.bias", "vision_encoder/embedding/bias"),
    Rule(_TOWER + "embeddings.position_embedding.weight", "vision_encoder/position_embedding/embedding"),
    *(
        rule
        for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"))
        for rule in (
            Rule(_HF_BLOCK + f"self_attn.{theirs}.weight", f"{_BLOCK}/attention/{ours}/kernel", Linear()),
            Rule(_HF_BLOCK + f"self_attn.{theirs}.bias", f"{_BLOCK}/attention/{ours}/bias", Reshape()),
        )
    ),
    Rule(_HF_BLOCK + "self_attn.out_proj.weight", f"{_BLOCK}/attention/out/kernel", Linear(in_ndim=2)),
    Rule(_HF_BLOCK + "self_attn.out_proj.bias", f"{_BLOCK}/attention/out/bias"),
    Rule(_HF_BLOCK + "mlp.fc1.weight", f"{_BLOCK}/mlp/wi/kernel", Linear()),
    Rule(_HF_BLOCK + "mlp.fc1.bias", f"{_BLOCK}/mlp/wi/bias"),
    Rule(_HF_BLOCK + "mlp.fc2.weight", f"{_BLOCK}/mlp/wo/kernel", Linear()),
    Rule(_HF_BLOCK + "mlp.fc2.bias", f"{_BLOCK}/mlp/wo/bias"),
    *(
        Rule(_HF_BLOCK + f"{theirs}.{field}", f"{_BLOCK}/{ours}/{param}")
        for ours, theirs in (("pre_attention_norm", "layer_norm1"), ("pre_mlp_norm", "layer_norm2"))
        for field, param in (("weight", "scale"), ("bias", "bias"))
    ),
    Rule(_TOWER + "post_layernorm.weight", "vision_encoder/encoder_norm/scale"),
    Rule(_TOWER + "post_layernorm.bias", "vision_encoder/encoder_norm/bias"),
    Rule(_PROJECTOR + "mm_input_projection_weight", "vision_projector/mm_input_projection/kernel", Copy()),
    Rule(_PROJECTOR + "mm_soft_emb_norm.weight", "vision_projector/mm_soft_embedding_norm/scale", PlusOne()),
)
MULTIMODAL_RULES = (
    *(dataclasses.replace(rule, hf=_multimodal_text_name(rule.hf)) for rule in RULES),
    *VISION_RULES,
)

MULTIMODAL_CONFIG_CLASS = ConfigClass(
    "Gemma3Config",
    {
        "text_config": None,
        "vision_config": None,
        "mm_tokens_per_image": 256,
        "boi_token_index": 255_999,
        "eoi_token_index": 256_000,
        "image_token_index": 262_144,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
    },
    aliases={"image_token_id": "image_token_index", "boi_token_id": "boi_token_index", "eoi_token_id": "eoi_token_index"},
)
# SiglipVisionConfig's defaults of the fields the tower reads (transformers fills an absent one with these).
VISION_CONFIG_CLASS = ConfigClass(
    "SiglipVisionConfig",
    {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "vision_use_head": True,
    },
)


def _sub_config(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
  value = raw.get(key) or {}
  if not isinstance(value, Mapping):
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be an object")
  return value


def _multimodal_config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = MULTIMODAL_CONFIG_CLASS.read(raw)
  vision = VISION_CONFIG_CLASS.read(_sub_config(raw, "vision_config"))
  if vision["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise HFError(
        f"{CONFIG_FILE}: vision_config.hidden_act={vision['hidden_act']!r} is not supported; maxbridge's SigLIP "
        "uses the tanh GELU (gelu_pytorch_tanh)"
    )
  for key in ("image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size"):
    if not isinstance(vision[key], int) or isinstance(vision[key], bool):
      raise HFError(f"{CONFIG_FILE}: vision_config.{key}={vision[key]!r} must be an integer (square images, patches)")
  values = _config_from_hf(_sub_config(raw, "text_config"))
  return {
      **values,
      # The top-level field ties lm_head (Gemma3ForConditionalGeneration's _tied_weights_keys).
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
      "use_multimodal": True,
      "image_size_for_vit": vision["image_size"],
      "num_channels_for_vit": vision["num_channels"],
      "patch_size_for_vit": vision["patch_size"],
      "conv_stride_for_vit": vision["patch_size"],
      "hidden_size_for_vit": vision["hidden_size"],
      "intermediate_size_for_vit": vision["intermediate_size"],
      "num_hidden_layers_for_vit": get_int(vision, "num_hidden_layers"),
      "num_attention_heads_for_vit": get_int(vision, "num_attention_heads"),
      "normalization_layer_epsilon_for_vit": get_float(vision, "layer_norm_eps"),
      "vision_output_length": get_int(hf, "mm_tokens_per_image"),
      "image_placeholder": "<start_of_image>",
      "image_token_index": get_int(hf, "image_token_index"),
      "boi_token_index": get_int(hf, "boi_token_index"),
      "eoi_token_index": get_int(hf, "eoi_token_index"),
  }


def _multimodal_config_to_hf(config: Config) -> dict[str, Any]:
  text = {**_config_to_hf(config), "model_type": "gemma3_text"}
  text.setdefault("max_position_embeddings", config.max_target_length)
  return {
      "text_config": text,
      "vision_config": {
          "model_type": "siglip_vision_model",
          "hidden_size": config.hidden_size_for_vit,
          "intermediate_size": config.intermediate_size_for_vit,
          "num_hidden_layers": config.num_hidden_layers_for_vit,
          "num_attention_heads": config.num_attention_heads_for_vit,
          "num_channels": config.num_channels_for_vit,
          "image_size": config.image_size_for_vit,
          "patch_size": config.patch_size_for_vit,
          "hidden_act": "gelu_pytorch_tanh",
          "layer_norm_eps": config.normalization_layer_epsilon_for_vit,
          "vision_use_head": False,
      },
      "mm_tokens_per_image": config.vision_output_length,
      "image_token_index": config.image_token_index,
      "boi_token_index": config.boi_token_index,
      "eoi_token_index": config.eoi_token_index,
      "tie_word_embeddings": config.logits_via_embedding,
  }


def language_model_tensors(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
  """(a ConditionalGeneration folder's language model, named as Gemma3ForCausalLM's, the tower's names left out)."""
  text, dropped = {}, []
  for name, tensor in tensors.items():
    name = _normalized_name(name)
    if name == _MULTIMODAL_HEAD:
      text[_TEXT_HEAD] = tensor
    elif name.startswith(_MULTIMODAL_TEXT_PREFIX):
      text[_TEXT_PREFIX + name.removeprefix(_MULTIMODAL_TEXT_PREFIX)] = tensor
    else:
      dropped.append(name)
  return text, dropped


FAMILY = Family(
    decoder_blocks=("gemma3",),
    stacks=(
        Stack("layers", "gemma3", depth=lambda config: config.num_decoder_layers // PATTERN, sublayers=SUBLAYERS),
        Stack("layers_remainder", "gemma3_local", depth=_remainder),
    ),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # the QK-norm would undo it
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,  # unused: use_qk_norm refuses QK-Clip (the config's shared rule)
    hf=(
        HFFamily(
            "gemma3",
            "Gemma3ForConditionalGeneration",
            ("gemma3",),
            MULTIMODAL_RULES,
            _multimodal_config_from_hf,
            _multimodal_config_to_hf,
            MULTIMODAL_CONFIG_CLASS,
            normalize_embedding_logits=True,
            # SigLIP's attention-pooling head, which Gemma 3 never reads (it takes the last hidden states).
            normalize_name=_normalized_name,
            ignored=(r"vision_tower\.head\..*",),
            exports=lambda config: config.use_multimodal,
            language_model=language_model_tensors,
        ),
        HFFamily(
            "gemma3_text",
            "Gemma3ForCausalLM",
            ("gemma3",),
            RULES,
            _config_from_hf,
            _config_to_hf,
            CONFIG_CLASS,
            normalize_embedding_logits=True,
        ),
    ),
    check=_check,
    ring_cache=False,  # windowed and global layers alternate: every layer caches every token
    layer_rope=True,
    maxtext_fixed=MAXTEXT_GEMMA2,
    vision_tower="siglip",
)
