"""RMSNorm and LayerNorm with logically partitioned parameters, and the config's choice of the two."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge import initializers
from maxbridge.config import Config
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


class LayerNorm(nnx.Module):
  """GPT-2's: a `scale` that is the multiplier itself, and a `bias`."""

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
    self.bias = nnx.Param(initializers.placeholder(rngs.params(), (num_features,), weight_dtype), out_sharding=("norm",))
    self.epsilon = epsilon
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.layer_norm(x, self.scale[...], self.bias[...], epsilon=self.epsilon, dtype=self.dtype)


def norm(config: Config, *, rngs: nnx.Rngs) -> nnx.Module:
  """The family's norm over the model width (`config.normalization`), with the config's epsilon and dtypes."""
  norm_class = LayerNorm if config.normalization == "layer_norm" else RMSNorm
  return norm_class(
      config.emb_dim,
      config.normalization_layer_epsilon,
      jnp.dtype(config.dtype),
      jnp.dtype(config.weight_dtype),
      rngs=rngs,
  )
