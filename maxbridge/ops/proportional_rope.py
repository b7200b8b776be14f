"""Proportional RoPE (Gemma 4's global layers): only the first pairs of each head turn.

transformers' "proportional" RoPE: of a head of width H, pairs (i, i + H/2) with
i < `pairs` turn at timescale theta ** (2i / H), the whole head's timescales, not
those of a narrower head (unlike `rotary.apply_partial_rotary`); the other pairs
do not turn at all.
"""

import jax
import jax.numpy as jnp


def apply_proportional_rotary(x: jax.Array, positions: jax.Array, *, pairs: int, max_timescale: float) -> jax.Array:
  """Rotates the first `pairs` pairs (i, i + H/2) of `x` [B, T, N, H] by `positions` [B, T]."""
  if x.ndim != 4 or positions.shape != x.shape[:2]:
    raise ValueError(f"expects x [B, T, N, H] and positions [B, T]; got x {x.shape}, positions {positions.shape}")
  head_dim = x.shape[-1]
  if head_dim % 2 or not 0 <= pairs <= head_dim // 2:
    raise ValueError(f"a head of width {head_dim} (even) has {head_dim // 2} pairs; asked to turn {pairs}")
  with jax.named_scope("proportional_rotary"):
    index = jnp.arange(head_dim // 2, dtype=jnp.float32)
    # A pair that does not turn has frequency 0: angle 0, cos 1, sin 0.
    frequency = jnp.where(index < pairs, max_timescale ** (-2 * index / head_dim), 0.0)
    angle = positions[:, :, None, None].astype(jnp.float32) * frequency  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
