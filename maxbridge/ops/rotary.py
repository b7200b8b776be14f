"""Rotary position embeddings in the Llama "rotate_half" layout, with Llama 3.1's frequency scaling."""

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  """Llama 3.1's RoPE scaling (Hugging Face `rope_type="llama3"`, MaxText `rope_type="llama3.1"`).

  Pairs whose wavelength is shorter than original_max_position /
  high_freq_factor keep their frequency; those longer than
  original_max_position / low_freq_factor turn `factor` times slower; the band
  between blends the two linearly in original_max_position / wavelength.
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int

  def __call__(self, timescale: jax.Array) -> jax.Array:
    """Scaled per-pair timescales (1 / frequency)."""
    wavelength = 2 * math.pi * timescale
    frequency = 1.0 / timescale
    slow = frequency / self.factor
    blend = (self.original_max_position / wavelength - self.low_freq_factor) / (
        self.high_freq_factor - self.low_freq_factor
    )
    scaled = jnp.where(wavelength > self.original_max_position / self.low_freq_factor, slow, frequency)
    band = (wavelength >= self.original_max_position / self.high_freq_factor) & (
        wavelength <= self.original_max_position / self.low_freq_factor
    )
    scaled = jnp.where(band, (1 - blend) * slow + blend * frequency, scaled)
    return 1.0 / scaled


def scaling_from_config(config) -> Llama3Scaling | None:
  """Llama 3.1's RoPE frequency scaling from a config's `rope_*` keys, or None for plain RoPE."""
  if not config.llama3_rope_scaling:
    return None
  return Llama3Scaling(
      config.rope_factor,
      config.rope_low_freq_factor,
      config.rope_high_freq_factor,
      config.original_max_position_embeddings,
  )


def apply_rotary(
    x: jax.Array,
    positions: jax.Array,
    *,
    max_timescale: float,
    min_timescale: float = 1.0,
    interleave: bool = False,
    scaling: Llama3Scaling | None = None,
) -> jax.Array:
  """Rotates `x` [B, T, N, H] by `positions` [B, T]; pairs are (i, i + H/2).

  `interleave=True` reads pairs (2i, 2i + 1) instead (DeepSeek's MLA layout) and
  returns them de-interleaved, evens then odds, as Hugging Face does; queries
  and keys are permuted alike, so their dot products are those of the pairs.
  `scaling` rescales the pairs' timescales (Llama 3.1).
  """
  if x.ndim != 4 or positions.shape != x.shape[:2]:
    raise ValueError(
        f"apply_rotary expects x [B, T, N, H] and positions [B, T]; got x {x.shape}, " f"positions {positions.shape}"
    )
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
  with jax.named_scope("rotary"):
    fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    timescale = min_timescale * (max_timescale / min_timescale) ** fraction
    if scaling is not None:
      timescale = scaling(timescale)
    angle = positions[:, :, None, None].astype(jnp.float32) / timescale  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x32 = x.astype(jnp.float32)
    if interleave:
      first, second = x32[..., 0::2], x32[..., 1::2]
    else:
      first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
