"""RMSNorm as in MaxText/Llama: x * rsqrt(mean(x^2) + eps) * scale."""

import functools
import jax
import jax.numpy as jnp

from maxbridge.core import sharding

_ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")


def _rms_normalized(x: jax.Array, epsilon: float) -> jax.Array:
  # Statistics in float32 even for bfloat16 activations: the mean of squares
  # loses most of its bits otherwise.
  x32 = x.astype(jnp.float32)
  mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return x32 * jax.lax.rsqrt(mean_square + epsilon)


# Jitted for its trace, as `attention._attend`: every norm of one shape reuses it. The constraint stays outside.
@functools.partial(jax.jit, static_argnames=("epsilon", "dtype"))
def _scaled_rms_norm(x: jax.Array, scale: jax.Array, epsilon: float, dtype: jnp.dtype) -> jax.Array:
  return _rms_normalized(x, epsilon).astype(dtype) * scale.astype(dtype)


def rms_norm(x: jax.Array, scale: jax.Array, *, epsilon: float, dtype: jnp.dtype) -> jax.Array:
  with jax.named_scope("rms_norm"):
    return sharding.constrain(_scaled_rms_norm(x, scale, epsilon, jnp.dtype(dtype)), _ACTIVATION_AXES)


def zero_centred_rms_norm(x: jax.Array, scale: jax.Array, *, epsilon: float, dtype: jnp.dtype) -> jax.Array:
  """RMSNorm times (1 + scale): Qwen3-Next's, whose `scale` starts at zero so that weight decay pulls the
  multiplier toward 1, not 0.

  The multiplier is formed and applied in float32, as transformers' Qwen3NextRMSNorm does: in bfloat16,
  1 + scale would round away a small scale's bits.
  """
  with jax.named_scope("zero_centred_rms_norm"):
    y = _rms_normalized(x, epsilon) * (1.0 + scale.astype(jnp.float32))
    return sharding.constrain(y.astype(dtype), _ACTIVATION_AXES)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *, epsilon: float, dtype: jnp.dtype) -> jax.Array:
  """LayerNorm as in GPT-2: (x - mean) * rsqrt(var + eps) * scale + bias, statistics in float32."""
  with jax.named_scope("layer_norm"):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = ((x32 - mean) * jax.lax.rsqrt(variance + epsilon)).astype(dtype)
    return y * scale.astype(dtype) + bias.astype(dtype)


def rms_norm_across_heads(x: jax.Array, scale: jax.Array, *, epsilon: float, dtype: jnp.dtype) -> jax.Array:
  """RMSNorm of each token's [heads, head_dim] as one vector: OLMo 2's QK-norm over the whole projection.

  `scale` is flat [heads * head_dim], as the projection it normalises was
  before its heads were split. Statistics in float32, as `rms_norm`'s.
  """
  with jax.named_scope("rms_norm_across_heads"):
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x32), axis=(-2, -1), keepdims=True)
    y = (x32 * jax.lax.rsqrt(mean_square + epsilon)).astype(dtype)
    return y * scale.reshape(x.shape[-2:]).astype(dtype)
