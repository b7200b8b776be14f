"""RMSNorm (plain or zero-centred) and LayerNorm with logically partitioned parameters, and the config's choice."""

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import normalization
from nnx_models import Module


class _Norm(Module):
  has_bias: ClassVar[bool] = False

  def __init__(
      self,
      num_features: int,
      epsilon: float,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      *,
      rngs: nnx.Rngs,
  ):
    def vector() -> nnx.Param:  # a per-feature parameter, on the logical axis `norm`
      return nnx.Param(initializers.placeholder(rngs.params(), (num_features,), weight_dtype), out_sharding=("norm",))

    self.scale = vector()
    if self.has_bias:
      self.bias = vector()
    self.epsilon = epsilon
    self.dtype = dtype


class RMSNorm(_Norm):

  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.rms_norm(x, self.scale[...], epsilon=self.epsilon, dtype=self.dtype)


class ZeroCentredRMSNorm(_Norm):
  """Qwen3-Next's: `scale` holds w of the multiplier 1 + w (`ops.normalization.zero_centred_rms_norm`)."""

  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.zero_centred_rms_norm(x, self.scale[...], epsilon=self.epsilon, dtype=self.dtype)


class AcrossHeadsRMSNorm(_Norm):
  """OLMo 2's QK-norm: one RMSNorm over a token's [heads, head_dim] together; `scale` is flat, as Hugging Face's."""

  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.rms_norm_across_heads(x, self.scale[...], epsilon=self.epsilon, dtype=self.dtype)


class LayerNorm(_Norm):
  """GPT-2's: a `scale` that is the multiplier itself, and a `bias`."""

  has_bias = True

  def __call__(self, x: jax.Array) -> jax.Array:
    scale, bias = self.scale[...], self.bias[...]
    return normalization.layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=self.dtype)


def norm(config: Config, *, rngs: nnx.Rngs) -> nnx.Module:
  """The family's norm over the model width (`config.normalization`), with the config's epsilon and dtypes."""
  norm_class = {"layer_norm": LayerNorm, "zero_centred_rms_norm": ZeroCentredRMSNorm}.get(config.normalization, RMSNorm)
  return norm_class(
      config.emb_dim,
      config.normalization_layer_epsilon,
      jnp.dtype(config.dtype),
      jnp.dtype(config.weight_dtype),
      rngs=rngs,
  )
