"""What the config's quantization keys ask for: which library (AQT or Qwix), train or serve, and Qwix's rules.

`quantization` names the numbers ("" = float); `use_qwix_quantization` picks
the library; `checkpoint_is_quantized` serves frozen quantized weights instead
of training float ones (`config_rules` checks which combinations are valid).
The matmuls these decide are `maxbridge.ops.quantization`'s; Qwix's
interception of a decoder is `maxbridge.models.quantized`'s.
"""

from typing import Any

import jax.numpy as jnp
import qwix

# A `maxbridge.core.config.Config`, read by attribute only.
Config = Any


def is_quantized(config: Config) -> bool:
  return bool(config.quantization)


def uses_aqt(config: Config) -> bool:
  return is_quantized(config) and not config.use_qwix_quantization


def uses_qwix(config: Config) -> bool:
  return is_quantized(config) and config.use_qwix_quantization


def serves_quantized(config: Config) -> bool:
  """Whether dense kernels are held as frozen quantized values and scales (serve mode: AQT, or Qwix PTQ)."""
  return is_quantized(config) and config.checkpoint_is_quantized


def qwix_rules(config: Config, decoder_path: str = "decoder") -> list:
  """Qwix QAT rules, MaxText's: every weight matmul inside the decoder; the embedding lookup stays float.

  `decoder_path` is the decoder's own path as Qwix sees it: "decoder" in a
  Linen top-level model, "" where the decoder is Qwix's root (an NNX decoder,
  or a Linen one behind a ToNNX). Either way the rules match the modules
  below it, and never the decoder itself (the tied head stays float).
  Only `dot_general` and `ragged_dot` (dropless experts) ops are rules' targets: the attention einsums
  multiply activations by activations, which MaxText's Qwix recipes leave in float.
  """
  q = config.quantization
  common = dict(module_path=f"{decoder_path}/.+" if decoder_path else ".+", op_names=("dot_general", "ragged_dot"))
  if q == "int8":  # weights and activations, gradients too
    return [qwix.QtRule(weight_qtype=jnp.int8, act_qtype=jnp.int8, bwd_qtype=jnp.int8, **common)]
  if q == "int4":  # weight-only
    return [qwix.QtRule(weight_qtype=jnp.int4, **common)]
  if q == "fp8":  # e4m3 forward, e5m2 backward
    return [qwix.QtRule(weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2, **common)]
  raise ValueError(f"Qwix quantization {q!r} is not built; valid values: 'int8', 'int4', 'fp8'")
