"""DenseGeneral: a kernel of shape in_features + out_features with logical axes.

`dot_general` is the matmul (`jax.lax.dot_general`, or a quantized one, as
flax's `Dense` takes it). Initial values come from `maxbridge.initializers`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxbridge import initializers, quantization
from maxbridge.config import Config
from maxbridge.ops import linear


class DenseGeneral(nn.Module):
  in_features: tuple[int, ...]
  out_features: tuple[int, ...]
  logical_axes: tuple[str, ...]
  dtype: jnp.dtype = jnp.float32
  weight_dtype: jnp.dtype = jnp.float32
  use_bias: bool = False
  dot_general: linear.DotGeneral = jax.lax.dot_general

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(initializers.placeholder, self.logical_axes),
        self.in_features + self.out_features,
        self.weight_dtype,
    )
    bias = None
    if self.use_bias:
      bias = self.param(
          "bias",
          nn.with_logical_partitioning(initializers.placeholder, self.logical_axes[len(self.in_features) :]),
          self.out_features,
          self.weight_dtype,
      )
    return linear.dense_general(
        x, kernel, in_ndim=len(self.in_features), dtype=self.dtype, bias=bias, dot_general=self.dot_general
    )


def dense(
    config: Config, in_features: tuple[int, ...], out_features: tuple[int, ...], logical_axes: tuple[str, ...], **kwargs
) -> DenseGeneral:
  """A `DenseGeneral` with the config's dtypes and matmul (`maxbridge.quantization`): the one place a layer's
  matmul settings come from."""
  kwargs.setdefault("dot_general", quantization.linen_dot_general(config))
  return DenseGeneral(
      in_features,
      out_features,
      logical_axes,
      dtype=jnp.dtype(config.dtype),
      weight_dtype=jnp.dtype(config.weight_dtype),
      **kwargs,
  )
