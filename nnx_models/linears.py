"""DenseGeneral: a kernel of shape in_features + out_features with logical axes.

`dot_general` is the matmul (`jax.lax.dot_general`, or a quantized one, as
flax's `Linear` takes it). Initial values come from `maxbridge.initializers`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge import initializers, quantization
from maxbridge.config import Config
from maxbridge.ops import linear


class DenseGeneral(nnx.Module):

  def __init__(
      self,
      in_features: tuple[int, ...],
      out_features: tuple[int, ...],
      logical_axes: tuple[str, ...],
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      use_bias: bool = False,
      dot_general: linear.DotGeneral = jax.lax.dot_general,
      *,
      rngs: nnx.Rngs,
  ):
    shape = tuple(in_features) + tuple(out_features)
    self.kernel = nnx.Param(
        initializers.placeholder(rngs.params(), shape, weight_dtype), out_sharding=tuple(logical_axes)
    )
    if use_bias:
      self.bias = nnx.Param(
          initializers.placeholder(rngs.params(), tuple(out_features), weight_dtype),
          out_sharding=tuple(logical_axes[len(in_features) :]),
      )
    self.use_bias = use_bias
    self.in_ndim = len(in_features)
    self.dtype = dtype
    self.dot_general = dot_general

  def __call__(self, x: jax.Array) -> jax.Array:
    bias = self.bias[...] if self.use_bias else None
    return linear.dense_general(
        x, self.kernel[...], in_ndim=self.in_ndim, dtype=self.dtype, bias=bias, dot_general=self.dot_general
    )


def dense(
    config: Config, in_features: tuple[int, ...], out_features: tuple[int, ...], logical_axes: tuple[str, ...], **kwargs
) -> DenseGeneral:
  """A `DenseGeneral` with the config's dtypes and matmul (`maxbridge.quantization`): the one place a layer's
  matmul settings come from."""
  kwargs.setdefault("dot_general", quantization.nnx_dot_general(config))
  return DenseGeneral(
      in_features,
      out_features,
      logical_axes,
      dtype=jnp.dtype(config.dtype),
      weight_dtype=jnp.dtype(config.weight_dtype),
      **kwargs,
  )
