"""Causal grouped-query dot-product attention with packed-sequence (segment) masking."""

import jax
import jax.numpy as jnp

from maxbridge import sharding

# A large finite negative, not -inf: a fully masked row then gives a uniform
# softmax instead of NaNs that would poison the gradients.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(segment_ids: jax.Array, sliding_window_size: int = 0) -> jax.Array:
  """[B, T] segment ids -> [B, 1, 1, T, S] boolean: causal and within one segment.

  With `sliding_window_size` W > 0, query i also sees only keys j > i - W (the
  last W positions, itself included), as Mistral and Hugging Face define it.
  """
  length = segment_ids.shape[1]
  distance = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
  causal = distance >= 0
  if sliding_window_size:
    causal &= distance < sliding_window_size
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_segment)[:, None, None]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    segment_ids: jax.Array,
    *,
    sliding_window_size: int = 0,
    query_scale: float | None = None,
) -> jax.Array:
  """query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv], segment_ids [B, T] -> [B, T, N, Hv].

  Query head j reads kv head j // (N / K). For Llama the 1/sqrt(H) factor
  lives in the query kernel (as in MaxText), so scores are not scaled here;
  families that cannot fold it (query/key norms, MLA, GPT-3) pass
  `query_scale`, applied to the query before the product as MaxText does.
  """
  batch, length, num_heads, head_dim = query.shape
  num_kv_heads = key.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} kv heads")
  with jax.named_scope("dot_product_attention"):
    if query_scale is not None:
      query = query * jnp.asarray(query_scale, query.dtype)
    query = query.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", query, key).astype(jnp.float32)
    scores = jnp.where(attention_mask(segment_ids, sliding_window_size), scores, MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights, value)
    out = out.reshape(batch, length, num_heads, value.shape[-1])
    return sharding.constrain(out, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
