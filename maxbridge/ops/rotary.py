"""Rotary position embeddings in the Llama "rotate_half" layout."""
import jax
import jax.numpy as jnp


def apply_rotary(
    x: jax.Array, positions: jax.Array, *, max_timescale: float, min_timescale: float = 1.0
) -> jax.Array:
  """Rotates `x` [B, T, N, H] by `positions` [B, T]; pairs are (i, i + H/2)."""
  if x.ndim != 4 or positions.shape != x.shape[:2]:
    raise ValueError(
        f"apply_rotary expects x [B, T, N, H] and positions [B, T]; got x {x.shape}, "
        f"positions {positions.shape}"
    )
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
  with jax.named_scope("rotary"):
    fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    timescale = min_timescale * (max_timescale / min_timescale) ** fraction
    angle = positions[:, :, None, None].astype(jnp.float32) / timescale  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
