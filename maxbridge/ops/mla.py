"""Multi-head latent attention (DeepSeek-V2/V3): decoupled RoPE on queries and keys.

Each query/key head is [nope | rope]: the first `nope_dim` features carry no
position; the last ones are rotated, in DeepSeek's interleaved pair layout.
Keys share one rope part across heads (it comes from the latent projection).

With `rope_type=yarn` (DeepSeek-V3, Kimi-K2) the rope part turns at YaRN's
frequencies (`rotary.YarnScaling`), as transformers' DeepseekV3; the rotated
parts are multiplied by YaRN's 0.1 ln(factor) + 1 only where
`rope_attention_scaling` asks (MaxText's key), and the softmax scale
1/sqrt(nope + rope) by mscale(factor, `mscale`)^2 (Hugging Face's
`mscale_all_dim`).
"""

import dataclasses

import jax
import jax.numpy as jnp

from maxbridge.core.families import attention as attention_spec
from maxbridge.ops import rotary

# DeepSeek's reference code and Hugging Face build the latent RMSNorms (q_norm,
# kv_norm) with their default epsilon, whatever the model's rms_norm_eps.
LATENT_NORM_EPSILON = 1e-6


@dataclasses.dataclass(frozen=True)
class MLAYarnScaling(rotary.YarnScaling):
  """YaRN's frequencies; the rotated parts are multiplied by its attention factor only where `scale_rotated`
  (MaxText's rope_attention_scaling: false for DeepSeek-V3, whose Hugging Face factor mscale / mscale_all_dim is 1)."""

  scale_rotated: bool = False

  @property
  def attention_factor(self) -> float:
    return super().attention_factor if self.scale_rotated else 1.0


def rope(config) -> dict:
  """`rope_query`'s and `rope_key`'s RoPE arguments for a config: theta, and YaRN where rope_type=yarn."""
  scaling = None
  if config.rope_type == "yarn":
    yarn = rotary.scaling_from_config(config)
    scaling = MLAYarnScaling(**dataclasses.asdict(yarn), scale_rotated=config.rope_attention_scaling)
  return dict(max_timescale=config.rope_max_timescale, scaling=scaling)


def softmax_scale(config) -> float:
  """1/sqrt(nope + rope), times mscale(rope_factor, mscale)^2 with YaRN (transformers' `yarn_apply_mscale`,
  DeepSeek's `softmax_scale`); mscale=0 leaves it unscaled."""
  scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
  if config.rope_type == "yarn" and config.mscale:
    scale *= attention_spec.yarn_mscale(config.rope_factor, config.mscale) ** 2
  return scale


def rope_query(
    query: jax.Array,
    positions: jax.Array,
    *,
    nope_dim: int,
    max_timescale: float,
    scaling: MLAYarnScaling | None = None,
) -> jax.Array:
  """query [B, T, N, nope + rope] -> the same with its rope part rotated."""
  nope, rope_part = jnp.split(query, [nope_dim], axis=-1)
  rope_part = rotary.apply_rotary(rope_part, positions, max_timescale=max_timescale, interleave=True, scaling=scaling)
  return jnp.concatenate([nope, rope_part], axis=-1)


def rope_key(
    key_rope: jax.Array, positions: jax.Array, *, max_timescale: float, scaling: MLAYarnScaling | None = None
) -> jax.Array:
  """The shared key rope part [B, T, rope], rotated by `positions` [B, T] (what a decode cache keeps)."""
  rotated = rotary.apply_rotary(
      key_rope[:, :, None, :], positions, max_timescale=max_timescale, interleave=True, scaling=scaling
  )
  return rotated[:, :, 0]


def latent_key_value(key_value: jax.Array, rotated_key_rope: jax.Array, *, nope_dim: int) -> tuple[jax.Array, jax.Array]:
  """Up-projected latents [B, S, N, nope + v] and the rotated shared key rope part [B, S, rope] -> (key, value).

  key [B, S, N, nope + rope] is each head's nope part joined to the one
  rotated rope part; value [B, S, N, v].
  """
  key_nope, value = jnp.split(key_value, [nope_dim], axis=-1)
  key_rope = jnp.broadcast_to(rotated_key_rope[:, :, None, :], (*key_nope.shape[:3], rotated_key_rope.shape[-1]))
  return jnp.concatenate([key_nope, key_rope], axis=-1), value
