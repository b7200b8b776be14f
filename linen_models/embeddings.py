"""Token embedding table [vocab, embed]."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxbridge.core import initializers
from maxbridge.ops import embedding as embedding_ops


class Embed(nn.Module):
  num_embeddings: int
  features: int
  dtype: jnp.dtype = jnp.float32
  weight_dtype: jnp.dtype = jnp.float32

  def setup(self):
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(initializers.placeholder, ("vocab", "embed")),
        (self.num_embeddings, self.features),
        self.weight_dtype,
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return embedding_ops.embed(tokens, self.embedding, dtype=self.dtype)
