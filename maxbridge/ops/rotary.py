"""Rotary position embeddings in the Llama "rotate_half" layout, with Llama 3.1's, YaRN's and linear frequency scaling."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from maxbridge.core.families import attention as attention_spec


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
    scaled = jnp.where(wavelength > self.original_max_position / self.low_freq_factor, slow, frequency)
    if self.high_freq_factor == self.low_freq_factor:  # no band to blend (Llama 4 Scout sets both to 1)
      return 1.0 / scaled
    blend = (self.original_max_position / wavelength - self.low_freq_factor) / (
        self.high_freq_factor - self.low_freq_factor
    )
    band = (wavelength >= self.original_max_position / self.high_freq_factor) & (
        wavelength <= self.original_max_position / self.low_freq_factor
    )
    scaled = jnp.where(band, (1 - blend) * slow + blend * frequency, scaled)
    return 1.0 / scaled

  @property
  def attention_factor(self) -> float:
    return 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN (Hugging Face `rope_type="yarn"`, MaxText `rope_type="yarn"`), as transformers' `_compute_yarn_parameters`.

  Pairs that turn more than `beta_fast` times over `original_max_position`
  keep their frequency, those turning fewer than `beta_slow` times turn
  `factor` times slower, and a linear ramp over the pair index blends the two
  between (its ends rounded outwards with `truncate`). The rotated queries and
  keys are also multiplied by `attention_factor`, 0.1 ln(factor) + 1, so the
  attention logits grow by its square.
  """

  factor: float
  beta_fast: float
  beta_slow: float
  original_max_position: int
  theta: float
  truncate: bool

  def __call__(self, timescale: jax.Array) -> jax.Array:
    """Scaled per-pair timescales (1 / frequency) of `timescale`, theta ** (2i / head_dim)."""
    pairs = timescale.shape[-1]
    dim = 2 * pairs

    def pair_turning(rotations: float) -> float:
      # The (fractional) pair index whose wavelength fits `rotations` times in the original context.
      return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

    low, high = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001  # as transformers: no zero-width ramp
    ramp = jnp.clip((jnp.arange(pairs, dtype=jnp.float32) - low) / (high - low), 0, 1)
    frequency = 1.0 / timescale
    # ramp 0 keeps the pair's frequency (extrapolation), 1 slows it by `factor` (interpolation).
    scaled = frequency / self.factor * ramp + frequency * (1 - ramp)
    return 1.0 / scaled

  @property
  def attention_factor(self) -> float:
    return attention_spec.yarn_mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
  """Every pair `factor` times slower: positions divided by `factor` (Hugging Face `rope_type="linear"`,
  MaxText's `rope_linear_scaling_factor`; Gemma 3's global layers)."""

  factor: float

  def __call__(self, timescale: jax.Array) -> jax.Array:
    return timescale * self.factor

  @property
  def attention_factor(self) -> float:
    return 1.0


def layer_rope(config, *, local: bool) -> dict:
  """`apply_rotary`'s max_timescale and scaling for a layer of a family with per-layer RoPE (Gemma 3).

  As MaxText: a sliding-window (`local`) layer turns at `local_rope_max_timescale`
  when it is positive and is never linearly scaled; a global layer turns at
  `rope_max_timescale`, slowed by `rope_linear_scaling_factor`. Families
  without per-layer RoPE keep those keys at -1 and 1.0 (config rules), which
  gives every layer the config's one RoPE.
  """
  if local:
    timescale = config.local_rope_max_timescale if config.local_rope_max_timescale > 0 else config.rope_max_timescale
    return dict(max_timescale=timescale, scaling=scaling_from_config(config))
  factor = config.rope_linear_scaling_factor
  scaling = LinearScaling(factor) if factor != 1.0 else scaling_from_config(config)
  return dict(max_timescale=config.rope_max_timescale, scaling=scaling)


def scaling_from_config(config) -> Llama3Scaling | YarnScaling | None:
  """Llama 3.1's or YaRN's RoPE frequency scaling from a config's `rope_*` keys, or None for plain RoPE."""
  if config.rope_type == "yarn":
    return YarnScaling(
        config.rope_factor,
        config.beta_fast,
        config.beta_slow,
        config.original_max_position_embeddings,
        float(config.rope_max_timescale),
        config.rope_truncate,
    )
  if not config.llama3_rope_scaling:
    return None
  return Llama3Scaling(
      config.rope_factor,
      config.rope_low_freq_factor,
      config.rope_high_freq_factor,
      config.original_max_position_embeddings,
  )


# Jitted for its trace, as `attention._attend`: queries and keys of every layer reuse it (it reads no mesh).
@functools.partial(jax.jit, static_argnames=("max_timescale", "min_timescale", "interleave", "scaling"))
def apply_rotary(
    x: jax.Array,
    positions: jax.Array,
    *,
    max_timescale: float,
    min_timescale: float = 1.0,
    interleave: bool = False,
    scaling: Llama3Scaling | YarnScaling | LinearScaling | None = None,
) -> jax.Array:
  """Rotates `x` [B, T, N, H] by `positions` [B, T]; pairs are (i, i + H/2).

  `interleave=True` reads pairs (2i, 2i + 1) instead (DeepSeek's MLA layout) and
  returns them de-interleaved, evens then odds, as Hugging Face does; queries
  and keys are permuted alike, so their dot products are those of the pairs.
  `scaling` rescales the pairs' timescales (Llama 3.1, YaRN, linear) and multiplies
  the result by its `attention_factor`.
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
    if scaling is not None and scaling.attention_factor != 1.0:
      rotated = rotated * scaling.attention_factor
    return rotated.astype(x.dtype)


def apply_partial_rotary(x: jax.Array, positions: jax.Array, *, rotary_dim: int, max_timescale: float) -> jax.Array:
  """`apply_rotary` on the first `rotary_dim` dims of each head only; the rest pass through (Qwen3-Next's
  partial_rotary_factor). Its pairs and timescales are those of a `rotary_dim`-wide head, as Hugging Face's."""
  if rotary_dim == x.shape[-1]:
    return apply_rotary(x, positions, max_timescale=max_timescale)
  turned = apply_rotary(x[..., :rotary_dim], positions, max_timescale=max_timescale)
  return jnp.concatenate([turned, x[..., rotary_dim:]], axis=-1)
