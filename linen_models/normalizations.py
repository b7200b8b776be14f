"""RMSNorm with a logically partitioned scale."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxbridge import initializers
from maxbridge.ops import normalization


class RMSNorm(nn.Module):
  num_features: int
  epsilon: float
  dtype: jnp.dtype = jnp.float32
  weight_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param(
        "scale",
        nn.with_logical_partitioning(initializers.placeholder, ("norm",)),
        (self.num_features,),
        self.weight_dtype,
    )
    return normalization.rms_norm(x, scale, epsilon=self.epsilon, dtype=self.dtype)
