"""DenseGeneral: a kernel of shape in_features + out_features with logical axes."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge import initializers
from maxbridge.ops import linear

_DEFAULT_KERNEL_INIT = initializers.kernel()


class DenseGeneral(nnx.Module):

  def __init__(
      self,
      in_features: tuple[int, ...],
      out_features: tuple[int, ...],
      logical_axes: tuple[str, ...],
      kernel_init: initializers.Initializer = _DEFAULT_KERNEL_INIT,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      use_bias: bool = False,
      *,
      rngs: nnx.Rngs,
  ):
    shape = tuple(in_features) + tuple(out_features)
    self.kernel = nnx.Param(kernel_init(rngs.params(), shape, weight_dtype), out_sharding=tuple(logical_axes))
    if use_bias:
      self.bias = nnx.Param(
          initializers.zeros()(rngs.params(), tuple(out_features), weight_dtype),
          out_sharding=tuple(logical_axes[len(in_features) :]),
      )
    self.use_bias = use_bias
    self.in_ndim = len(in_features)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    bias = self.bias[...] if self.use_bias else None
    return linear.dense_general(x, self.kernel[...], in_ndim=self.in_ndim, dtype=self.dtype, bias=bias)
