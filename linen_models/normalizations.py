"""RMSNorm (plain or zero-centred) and LayerNorm with logically partitioned parameters, and the config's choice."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import normalization


class _Norm(nn.Module):
  num_features: int
  epsilon: float
  dtype: jnp.dtype = jnp.float32
  weight_dtype: jnp.dtype = jnp.float32

  def vector(self, name: str) -> jax.Array:
    """A per-feature parameter, on the logical axis `norm`."""
    partitioned = nn.with_logical_partitioning(initializers.placeholder, ("norm",))
    return self.param(name, partitioned, (self.num_features,), self.weight_dtype)


class RMSNorm(_Norm):

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.rms_norm(x, self.vector("scale"), epsilon=self.epsilon, dtype=self.dtype)


class ZeroCentredRMSNorm(_Norm):
  """Qwen3-Next's: `scale` holds w of the multiplier 1 + w (`ops.normalization.zero_centred_rms_norm`)."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.zero_centred_rms_norm(x, self.vector("scale"), epsilon=self.epsilon, dtype=self.dtype)


class AcrossHeadsRMSNorm(_Norm):
  """OLMo 2's QK-norm: one RMSNorm over a token's [heads, head_dim] together; `scale` is flat, as Hugging Face's."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.rms_norm_across_heads(x, self.vector("scale"), epsilon=self.epsilon, dtype=self.dtype)


class LayerNorm(_Norm):
  """GPT-2's: a `scale` that is the multiplier itself, and a `bias`."""

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale, bias = self.vector("scale"), self.vector("bias")
    return normalization.layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=self.dtype)


def norm(config: Config, *, name: str) -> nn.Module:
  """The family's norm over the model width (`config.normalization`), with the config's epsilon and dtypes."""
  norm_class = {"layer_norm": LayerNorm, "zero_centred_rms_norm": ZeroCentredRMSNorm}.get(config.normalization, RMSNorm)
  return norm_class(
      config.emb_dim,
      config.normalization_layer_epsilon,
      jnp.dtype(config.dtype),
      jnp.dtype(config.weight_dtype),
      name=name,
  )
