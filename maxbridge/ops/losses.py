"""Token-level losses."""

import jax
import jax.numpy as jnp


def cross_entropy_with_z_loss(
    logits: jax.Array, targets: jax.Array, *, z_loss_multiplier: float = 0.0
) -> tuple[jax.Array, jax.Array]:
  """Per-token cross-entropy plus z-loss, and the z-loss alone: [B, T, V], [B, T] -> [B, T] each.

  The z-loss, z * logsumexp(logits)^2, keeps the softmax normaliser near 1
  (PaLM); it is added to the returned loss so that one gradient covers both.
  """
  with jax.named_scope("cross_entropy"):
    logits = logits.astype(jnp.float32)
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    z_loss = z_loss_multiplier * jnp.square(log_normalizer)
    return log_normalizer - target_logit + z_loss, z_loss


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """log p(target) at every position, in float32: logits [..., V], targets [...] -> [...]."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
