"""DenseGeneral: a kernel of shape in_features + out_features with logical axes.

`dot_general` is the matmul (`jax.lax.dot_general`, or a quantized one, as
flax's `Linear` takes it). Initial values come from `maxbridge.core.initializers`.
With `frozen` (AQT serve mode, see `maxbridge.ops.quantization`), the layer holds
`kernel_qvalue` and `kernel_scale` instead of `kernel`, and `frozen` makes the
matmul from them.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.ops import quantization
from maxbridge.core.config import Config
from maxbridge.ops import linear
from nnx_models import Module


class DenseGeneral(Module):

  def __init__(
      self,
      in_features: tuple[int, ...],
      out_features: tuple[int, ...],
      logical_axes: tuple[str, ...],
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      use_bias: bool = False,
      dot_general: linear.DotGeneral = jax.lax.dot_general,
      frozen: Callable[[jax.Array, jax.Array], linear.DotGeneral] | None = None,
      qvalue_dtype: jnp.dtype = jnp.int8,
      *,
      rngs: nnx.Rngs,
  ):
    shape, in_ndim = tuple(in_features) + tuple(out_features), len(in_features)
    if frozen is None:
      self.kernel = nnx.Param(
          initializers.placeholder(rngs.params(), shape, weight_dtype), out_sharding=tuple(logical_axes)
      )
    else:
      self.kernel_qvalue = nnx.Param(
          initializers.placeholder(rngs.params(), shape, qvalue_dtype), out_sharding=tuple(logical_axes)
      )
      self.kernel_scale = nnx.Param(
          initializers.placeholder(rngs.params(), quantization.scale_shape(shape, in_ndim), jnp.dtype(dtype)),
          out_sharding=quantization.scale_axes(tuple(logical_axes), in_ndim),
      )
    if use_bias:
      self.bias = nnx.Param(
          initializers.placeholder(rngs.params(), tuple(out_features), weight_dtype),
          out_sharding=tuple(logical_axes[len(in_features) :]),
      )
    self.use_bias = use_bias
    self.in_ndim = in_ndim
    self.shape = shape
    self.dtype = dtype
    self.dot_general = dot_general
    self.frozen = frozen

  def __call__(self, x: jax.Array) -> jax.Array:
    bias = self.bias[...] if self.use_bias else None
    if self.frozen is None:
      kernel, dot_general = self.kernel[...], self.dot_general
    else:
      kernel = jnp.zeros(self.shape, self.dtype)
      dot_general = self.frozen(self.kernel_qvalue[...], self.kernel_scale[...])
    return linear.dense_general(x, kernel, in_ndim=self.in_ndim, dtype=self.dtype, bias=bias, dot_general=dot_general)


def dense(
    config: Config, in_features: tuple[int, ...], out_features: tuple[int, ...], logical_axes: tuple[str, ...], **kwargs
) -> DenseGeneral:
  """A `DenseGeneral` with the config's dtypes and matmul (`maxbridge.ops.quantization`): the one place a layer's
  matmul settings come from."""
  kwargs.setdefault("dot_general", quantization.nnx_dot_general(config))
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
