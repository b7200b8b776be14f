"""RMSNorm with a logically partitioned scale."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge import initializers
from maxbridge.ops import normalization


class RMSNorm(nnx.Module):

  def __init__(
      self,
      num_features: int,
      epsilon: float,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      *,
      rngs: nnx.Rngs,
  ):
    self.scale = nnx.Param(initializers.placeholder(rngs.params(), (num_features,), weight_dtype), out_sharding=("norm",))
    self.epsilon = epsilon
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.rms_norm(x, self.scale[...], epsilon=self.epsilon, dtype=self.dtype)
