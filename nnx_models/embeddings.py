"""Token embedding table [vocab, embed]."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.ops import embedding as embedding_ops
from nnx_models import Module


class Embed(Module):

  def __init__(
      self,
      num_embeddings: int,
      features: int,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      *,
      rngs: nnx.Rngs,
  ):
    self.embedding = nnx.Param(
        initializers.placeholder(rngs.params(), (num_embeddings, features), weight_dtype),
        out_sharding=("vocab", "embed"),
    )
    self.dtype = dtype

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return embedding_ops.embed(tokens, self.embedding[...], dtype=self.dtype)
