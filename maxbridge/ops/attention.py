"""Causal grouped-query dot-product attention with packed-sequence (segment) masking."""
import jax
import jax.numpy as jnp

# A large finite negative, not -inf: a fully masked row then gives a uniform
# softmax instead of NaNs that would poison the gradients.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids -> [B, 1, 1, T, S] boolean: causal and within one segment."""
  length = segment_ids.shape[1]
  causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_segment)[:, None, None]


def dot_product_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array
) -> jax.Array:
  """query [B, T, N, H], key/value [B, S, K, H], segment_ids [B, T] -> [B, T, N, H].

  Query head j reads kv head j // (N / K). The 1/sqrt(H) factor lives in the
  query kernel (as in MaxText), so scores are not scaled here.
  """
  batch, length, num_heads, head_dim = query.shape
  num_kv_heads = key.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} kv heads")
  with jax.named_scope("dot_product_attention"):
    query = query.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", query, key).astype(jnp.float32)
    scores = jnp.where(attention_mask(segment_ids), scores, MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights, value)
    return out.reshape(batch, length, num_heads, head_dim)
