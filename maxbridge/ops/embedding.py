"""Token embedding lookup and the output projection (tied or untied)."""

import jax
import jax.numpy as jnp
from flax.nnx.nn.dtypes import promote_dtype

from maxbridge.core import sharding
from maxbridge.ops.linear import DotGeneral


def embed(tokens: jax.Array, embedding: jax.Array, *, dtype: jnp.dtype) -> jax.Array:
  """int [B, T] -> [B, T, D]; no scaling of embeddings (Llama)."""
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must be integers, got {tokens.dtype}")
  with jax.named_scope("embed"):
    # Gathered over fsdp first, as fsdp gathers every weight before use: a
    # lookup in a table split on its embed axis yields rows split that way,
    # which XLA can only reshard to batch-split rows by replicating them.
    embedding = sharding.constrain(embedding, ("vocab", None))
    x = jnp.take(embedding, tokens, axis=0).astype(dtype)
    return sharding.constrain(x, ("activation_batch", "activation_length", "activation_embed"))


def attend(
    x: jax.Array, embedding: jax.Array, *, dtype: jnp.dtype, dot_general: DotGeneral = jax.lax.dot_general
) -> jax.Array:
  """Tied output head: [B, T, D] x [V, D] -> float32 logits [B, T, V]; a weight matmul like `linear.dense_general`."""
  with jax.named_scope("attend"):
    x, embedding = promote_dtype((x, embedding), dtype=dtype)
    logits = dot_general(x, embedding, (((x.ndim - 1,), (1,)), ((), ())))
    logits = logits.astype(jnp.float32)
    return sharding.constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
