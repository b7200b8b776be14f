"""OLMo 3: OLMo 2's layers, three with a sliding window then one global, repeated.

As MaxText's Olmo3ScannableBlock, the decoder stacks blocks of four layers
(`SUBLAYERS`) and scans them, so the alternating windows need no loop over
layers: `base_num_decoder_layers` counts layers (a multiple of 4), the stack
holds a quarter as many blocks. Every layer caches every token while decoding
(`ring_cache=False`): the windowed ones mask by position.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxbridge.core.families import attention as attn
from maxbridge.core.families import llama, olmo2
from maxbridge.core.families.base import Config, Family, Stack, broken, key_value_cache, query_kernel_clip
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    get,
    get_int,
    rope_from_hf,
)

SUBLAYERS = ("local_0", "local_1", "local_2", "global")  # a block's layers, in depth order
GLOBAL = "global"  # the one that attends in full
_KINDS = ["sliding_attention"] * 3 + ["full_attention"]  # Hugging Face's layer_types of one block

CONFIG_CLASS = ConfigClass(
    "Olmo3Config",
    {**olmo2.CONFIG_CLASS.defaults, "sliding_window": 4096, "layer_types": None},
    default_theta=500000.0,
)
_olmo2_from_hf = llama.config_from_hf("olmo3", CONFIG_CLASS, biases=("attention_bias",), qk_norm=True)
_olmo2_to_hf = llama.config_to_hf("olmo3", qk_norm=True, window=True, fixed={"attention_bias": False})


def _rope(raw: Mapping[str, Any], hf: Mapping[str, Any]) -> dict[str, Any]:
  """The one RoPE both layer kinds must share, read as Olmo3Config builds each kind's.

  `rope_parameters` maps each kind to its own; a kind without one gets default
  RoPE with the class's theta (500000). The legacy `rope_scaling` and
  top-level `rope_theta` reach the full_attention layers only: the sliding
  ones keep the class's theta. Keys of a flat `rope_parameters` are not read.
  """
  parameters = hf["rope_parameters"] or {}
  if not isinstance(parameters, Mapping):
    raise HFError(f"{CONFIG_FILE}: rope_parameters={parameters!r} must be an object")
  per_kind = {}
  for kind in ("sliding_attention", "full_attention"):
    own = dict(parameters.get(kind) or {"rope_type": "default"})
    theta = CONFIG_CLASS.default_theta
    if kind == "full_attention":
      own.update(raw.get("rope_scaling") or {})
      theta = raw.get("rope_theta", theta)
    own.setdefault("rope_theta", theta)
    rope_type = own.get("rope_type", own.get("type", "default"))
    if rope_type != "default":
      field = "rope_scaling" if kind == "full_attention" and raw.get("rope_scaling") else f"rope_parameters.{kind}"
      raise HFError(
          f"{CONFIG_FILE}: {field} gives {kind} layers rope_type={rope_type!r}; maxbridge's olmo3 implements "
          "default RoPE only"
      )
    per_kind[kind] = rope_from_hf(
        {"rope_parameters": own, "max_position_embeddings": hf["max_position_embeddings"]},
        llama3=False,
        default_theta=CONFIG_CLASS.default_theta,
    )
  if per_kind["sliding_attention"] != per_kind["full_attention"]:
    thetas = {kind: values["rope_max_timescale"] for kind, values in per_kind.items()}
    raise HFError(
        f"{CONFIG_FILE}: rope_parameters (with rope_theta and rope_scaling, which transformers applies to "
        f"full_attention layers only) gives the two layer kinds different RoPE {thetas}; maxbridge's olmo3 rotates "
        "both alike"
    )
  return per_kind["full_attention"]


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  layers = get_int(hf, "num_hidden_layers")
  kinds = hf["layer_types"]
  if kinds is None:  # Olmo3Config's __post_init__: every fourth layer global
    kinds = _KINDS * (layers // 4) + ["sliding_attention"] * (layers % 4)
  if layers % 4 or kinds != _KINDS * (layers // 4):
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} with layer_types={kinds!r} is not supported; maxbridge's olmo3 "
        "stacks blocks of three sliding_attention layers then a full_attention one"
    )
  window = get(hf, "sliding_window", None)
  if window is None or get_int(hf, "sliding_window") <= 0:
    raise HFError(f"{CONFIG_FILE}: sliding_window={window!r} must be a positive integer")
  # llama's reader takes a flat rope_parameters: give it the one RoPE both kinds share.
  rope = _rope(raw, hf)
  flat = {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": rope["rope_max_timescale"]}}
  flat.pop("rope_scaling", None)
  return {**_olmo2_from_hf(flat), **rope, "sliding_window_size": window}


def _config_to_hf(config: Config) -> dict[str, Any]:
  theta = float(config.rope_max_timescale)
  return {
      **_olmo2_to_hf(config),
      "layer_types": _KINDS * (config.num_decoder_layers // 4),
      "rope_parameters": {kind: {"rope_type": "default", "rope_theta": theta} for kind in set(_KINDS)},
      "rope_scaling": None,
  }


def _check(config: Config) -> list[str]:
  norm = window = layers = None
  if not config.use_qk_norm:
    norm = "decoder_block='olmo3' normalises queries and keys over the whole projection: set use_qk_norm=true"
  if not config.sliding_window_size:
    window = "decoder_block='olmo3' gives three of every four layers a sliding window: set sliding_window_size > 0"
  if config.num_decoder_layers % len(SUBLAYERS):
    layers = (
        f"decoder_block='olmo3' stacks blocks of {len(SUBLAYERS)} layers: base_num_decoder_layers="
        f"{config.num_decoder_layers} must be a multiple of {len(SUBLAYERS)}"
    )
  return broken(norm, window, layers)


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """OLMo 2's, the sliding window on the `local` layers only."""
  del kv_shared
  return dataclasses.replace(olmo2.attention(config), sliding_window_size=config.sliding_window_size if local else 0)


FAMILY = Family(
    decoder_blocks=("olmo3",),
    stacks=(Stack("layers", "olmo3", depth=lambda config: config.num_decoder_layers // 4, sublayers=SUBLAYERS),),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # the QK-norm would undo it
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,
    hf=(HFFamily("olmo3", "Olmo3ForCausalLM", ("olmo3",), olmo2.RULES, _config_from_hf, _config_to_hf, CONFIG_CLASS),),
    check=_check,
    ring_cache=False,
)
