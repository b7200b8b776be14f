"""Logit soft-capping (Gemma 2): cap * tanh(x / cap), which bounds logits smoothly to (-cap, cap)."""

import jax
import jax.numpy as jnp


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
  """`x` squashed into (-cap, cap), near the identity for |x| << cap; `cap` 0 leaves it unchanged."""
  if not cap:
    return x
  cap = jnp.asarray(cap, x.dtype)
  return jnp.tanh(x / cap) * cap
