"""Multi-head latent attention (DeepSeek-V2/V3): decoupled RoPE on queries and keys.

Each query/key head is [nope | rope]: the first `nope_dim` features carry no
position; the last ones are rotated, in DeepSeek's interleaved pair layout.
Keys share one rope part across heads (it comes from the latent projection).
"""

import jax
import jax.numpy as jnp

from maxbridge.ops import rotary

# DeepSeek's reference code and Hugging Face build the latent RMSNorms (q_norm,
# kv_norm) with their default epsilon, whatever the model's rms_norm_eps.
LATENT_NORM_EPSILON = 1e-6


def rope_query(query: jax.Array, positions: jax.Array, *, nope_dim: int, max_timescale: float) -> jax.Array:
  """query [B, T, N, nope + rope] -> the same with its rope part rotated."""
  nope, rope = jnp.split(query, [nope_dim], axis=-1)
  rope = rotary.apply_rotary(rope, positions, max_timescale=max_timescale, interleave=True)
  return jnp.concatenate([nope, rope], axis=-1)


def rope_key(key_rope: jax.Array, positions: jax.Array, *, max_timescale: float) -> jax.Array:
  """The shared key rope part [B, T, rope], rotated by `positions` [B, T] (what a decode cache keeps)."""
  return rotary.apply_rotary(key_rope[:, :, None, :], positions, max_timescale=max_timescale, interleave=True)[:, :, 0]


def latent_key_value(key_value: jax.Array, rotated_key_rope: jax.Array, *, nope_dim: int) -> tuple[jax.Array, jax.Array]:
  """Up-projected latents [B, S, N, nope + v] and the rotated shared key rope part [B, S, rope] -> (key, value).

  key [B, S, N, nope + rope] is each head's nope part joined to the one
  rotated rope part; value [B, S, N, v].
  """
  key_nope, value = jnp.split(key_value, [nope_dim], axis=-1)
  key_rope = jnp.broadcast_to(rotated_key_rope[:, :, None, :], (*key_nope.shape[:3], rotated_key_rope.shape[-1]))
  return jnp.concatenate([key_nope, key_rope], axis=-1), value
