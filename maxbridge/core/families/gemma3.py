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
    HFError,
    HFFamily,
    Linear,
    Rule,
    get,
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
)
    vision_tower="siglip",
