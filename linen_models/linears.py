"""DenseGeneral: a kernel of shape in_features + out_features with logical axes.

`dot_general` is the matmul (`jax.lax.dot_general`, or a quantized one, as
flax's `Dense` takes it). Initial values come from `maxbridge.core.initializers`.
With `frozen` (AQT serve mode, see `maxbridge.ops.quantization`), the layer holds
`kernel_qvalue` and `kernel_scale` instead of `kernel`, and `frozen` makes the
matmul from them.
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxbridge.core import initializers
from maxbridge.ops import quantization
from maxbridge.core.config import Config
from maxbridge.ops import linear


class DenseGeneral(nn.Module):
  in_features: tuple[int, ...]
  out_features: tuple[int, ...]
  logical_axes: tuple[str, ...]
  dtype: jnp.dtype = jnp.float32
  weight_dtype: jnp.dtype = jnp.float32
  use_bias: bool = False
  dot_general: linear.DotGeneral = jax.lax.dot_general
  frozen: Callable[[jax.Array, jax.Array], linear.DotGeneral] | None = None
  qvalue_dtype: jnp.dtype = jnp.int8

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape, in_ndim = self.in_features + self.out_features, len(self.in_features)
    dot_general = self.dot_general
    if self.frozen is None:
      kernel = self.param(
          "kernel", nn.with_logical_partitioning(initializers.placeholder, self.logical_axes), shape, self.weight_dtype
      )
    else:
      qvalue = self.param(
          quantization.QVALUE,
          nn.with_logical_partitioning(initializers.placeholder, self.logical_axes),
          shape,
          self.qvalue_dtype,
      )
      scale = self.param(
          quantization.SCALE,
          nn.with_logical_partitioning(initializers.placeholder, quantization.scale_axes(self.logical_axes, in_ndim)),
          quantization.scale_shape(shape, in_ndim),
          jnp.dtype(self.dtype),
      )
      kernel, dot_general = jnp.zeros(shape, self.dtype), self.frozen(qvalue, scale)
    bias = None
    if self.use_bias:
      bias = self.param(
          "bias",
          nn.with_logical_partitioning(initializers.placeholder, self.logical_axes[len(self.in_features) :]),
          self.out_features,
          self.weight_dtype,
      )
    return linear.dense_general(x, kernel, in_ndim=in_ndim, dtype=self.dtype, bias=bias, dot_general=dot_general)


def dense(
    config: Config, in_features: tuple[int, ...], out_features: tuple[int, ...], logical_axes: tuple[str, ...], **kwargs
) -> DenseGeneral:
  """A `DenseGeneral` with the config's dtypes and matmul (`maxbridge.ops.quantization`): the one place a layer's
  matmul settings come from."""
  kwargs.setdefault("dot_general", quantization.linen_dot_general(config))
  kwargs.setdefault("frozen", quantization.frozen_dot_general(config))
  kwargs.setdefault("qvalue_dtype", quantization.qvalue_dtype(config))
  return DenseGeneral(
      in_features,
      out_features,
      logical_axes,
      dtype=jnp.dtype(config.dtype),
      weight_dtype=jnp.dtype(config.weight_dtype),
      **kwargs,
  )
