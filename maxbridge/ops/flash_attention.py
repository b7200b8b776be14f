"""Blockwise attention with an online softmax and its own backward pass: MaxText's `attention=flash` on the CPU.

The same result as `ops.attention.dot_product_attention`, masks and all, without
its [T, S] score matrix: queries are taken `block_q` at a time, keys and values
`block_kv` at a time, and each query block keeps a running row maximum `m`, sum
`l` and weighted sum of values `acc` as it reads the key blocks (Milakov and
Gimelshein's online softmax, as FlashAttention uses it). Besides its inputs, the
forward pass saves only its output and each row's maximum and sum; the backward
pass recomputes each block's softmax from them (`jax.custom_vjp`), so memory is
O(block_q x block_kv) per step and O(T x head_dim) in all.

A block whose every (query, key) pair is masked (above a causal diagonal,
outside a window or a chunk, across documents) is not multiplied. Its keys still
join each row's softmax at the mask value, as in `dot_product_attention`: a
weight of zero, except in a row that sees no key at all (which there, as here,
averages every value alike), added in closed form.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import sharding
from maxbridge.ops.attention_mask import MASK_VALUE, attention_mask
from maxbridge.ops.soft_cap import soft_cap

# Queries and keys per block (each clipped to the sequence's length): a step's scores are
# [B, N, BLOCK_Q, BLOCK_KV] float32, 256 KiB per batch row and head at these sizes.
BLOCK_Q = 128
BLOCK_KV = 512


@dataclasses.dataclass(frozen=True)
class _Blocks:
  """What the blockwise kernel needs besides arrays: true lengths (blocks are padded past them) and the mask."""

  length: int
  kv_length: int
  sliding_window_size: int
  chunk_size: int
  logits_soft_cap: float
  has_sinks: bool


def flash_attention(
    query: jax.Array,
    key: jax.Array | tuple[jax.Array, ...],
    value: jax.Array | tuple[jax.Array, ...],
    *,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    sliding_window_size: int = 0,
    chunk_size: int = 0,
    query_scale: float | None = None,
    return_max_logits: bool = False,
    logits_soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """`ops.attention.dot_product_attention`'s arguments and result, computed block by block.

  query [B, T, N, H], key [B, S, K, H] (or a tuple of blocks of one sequence,
  concatenated here), value likewise -> [B, T, N, Hv]; with `return_max_logits`,
  also each head's largest visible score [N] (QK-Clip), without gradient.
  The mask (`ops.attention_mask`) is built for each (query block, key block) pair
  from its positions and segment ids. `block_q` and `block_kv` default to `BLOCK_Q` and `BLOCK_KV` (read
  at each call); lengths need not be multiples of them: both are padded, and the
  padding masked. Context parallelism is refused: keys are not gathered here.
  """
  key, value = (key, value) if isinstance(key, tuple) else ((key,), (value,))
  batch, length, num_heads, head_dim = query.shape
  num_kv_heads = key[0].shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} kv heads")
  context = sharding.axis_size("context")
  if context > 1 and length % context == 0:  # not a decode step's query, which dot_product reads whole too
    raise ValueError(
        f"attention=flash cannot gather keys and values over the context axis (context parallelism of {context}): "
        "set attention=dot_product, or ici_context_parallelism=1"
    )
  key = key[0] if len(key) == 1 else jnp.concatenate(key, axis=1)
  value = value[0] if len(value) == 1 else jnp.concatenate(value, axis=1)
  kv_length, value_dim = key.shape[1], value.shape[-1]
  with jax.named_scope("flash_attention"):
    if query_scale is not None:
      query = query * jnp.asarray(query_scale, query.dtype)
    block_q, block_kv = min(block_q or BLOCK_Q, length), min(block_kv or BLOCK_KV, kv_length)
    num_q_blocks, num_kv_blocks = math.ceil(length / block_q), math.ceil(kv_length / block_kv)
    groups = num_heads // num_kv_heads
    # Blocks first, then batch and heads (the loops' axis, then every product's batch axes): query
    # [nq, B, K, G, bq, H], keys and values [nk, B, K, bk, H].
    query = _pad(query, 1, num_q_blocks * block_q).reshape(batch, num_q_blocks, block_q, num_kv_heads, groups, head_dim)
    query = query.transpose(1, 0, 3, 4, 2, 5)
    key, value = (
        _pad(x, 1, num_kv_blocks * block_kv)
        .reshape(batch, num_kv_blocks, block_kv, num_kv_heads, -1)
        .transpose(1, 0, 3, 2, 4)
        for x in (key, value)
    )
    q_segment_ids, q_positions = (_blocked(x, num_q_blocks, block_q) for x in (q_segment_ids, q_positions))
    kv_segment_ids, kv_positions = (_blocked(x, num_kv_blocks, block_kv) for x in (kv_segment_ids, kv_positions))
    if sinks is None:
      sinks_array = jnp.zeros((num_kv_heads, groups), jnp.float32)
    else:
      sinks_array = sinks.reshape(num_kv_heads, groups)
    blocks = _Blocks(
        length,
        kv_length,
        sliding_window_size,
        chunk_size,
        logits_soft_cap,
        sinks is not None,
    )
    out, max_logits = _flash(
        blocks, query, key, value, sinks_array, q_segment_ids, q_positions, kv_segment_ids, kv_positions
    )
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, num_q_blocks * block_q, num_heads, value_dim)[:, :length]
    out = sharding.constrain(out, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
    if not return_max_logits:
      return out
    return out, max_logits.reshape(num_heads)


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _blocked(ids: jax.Array, num_blocks: int, block: int) -> jax.Array:
  """Segment ids or positions [B, L] -> [num_blocks, B, block], padded with zeros (masked by index)."""
  return _pad(ids, 1, num_blocks * block).reshape(ids.shape[0], num_blocks, block).transpose(1, 0, 2)


def _valid(num_blocks: int, block: int, length: int) -> jax.Array:
  """[num_blocks, block] boolean: which of the padded blocks' rows are real."""
  return (np.arange(num_blocks)[:, None] * block + np.arange(block)) < length


def _visible(blocks: _Blocks, q_segment_ids, q_positions, q_valid, kv_segment_ids, kv_positions, kv_valid):
  """[B, 1, 1, bq, bk] boolean: which (query, key) pairs of one block pair attend (padding never does)."""
  visible = attention_mask(
      q_segment_ids, kv_segment_ids, q_positions, kv_positions, blocks.sliding_window_size, blocks.chunk_size
  )
  return visible & q_valid[:, None] & kv_valid


def _scores(blocks: _Blocks, query, key, visible, kv_valid) -> tuple[jax.Array, jax.Array]:
  """(raw scores, masked scores) [B, K, G, bq, bk] float32: masked pairs at the mask value, padded keys at -inf
  (no weight at all, whereas a masked key keeps dot_product's weight in a row that sees nothing)."""
  raw = jnp.einsum("BKGTH,BKSH->BKGTS", query, key, preferred_element_type=jnp.float32)
  masked = jnp.where(visible, soft_cap(raw, blocks.logits_soft_cap), MASK_VALUE)
  return raw, jnp.where(kv_valid, masked, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(blocks, query, key, value, sinks, q_segment_ids, q_positions, kv_segment_ids, kv_positions):
  out, _, max_logits = _forward(
      blocks, query, key, value, sinks, q_segment_ids, q_positions, kv_segment_ids, kv_positions
  )
  return out, max_logits


def _flash_forward(blocks, query, key, value, sinks, q_segment_ids, q_positions, kv_segment_ids, kv_positions):
  masking = (q_segment_ids, q_positions, kv_segment_ids, kv_positions)
  out, softmax_rows, max_logits = _forward(blocks, query, key, value, sinks, *masking)
  return (out, max_logits), (query, key, value, sinks, masking, out, softmax_rows)


def _forward(blocks: _Blocks, query, key, value, sinks, q_segment_ids, q_positions, kv_segment_ids, kv_positions):
  """Blocked inputs -> (out [nq, B, K, G, bq, Hv], (each row's max, sum) [nq, B, K, G, bq], max logits [K, G]).

  A row's max and sum are kept apart, not as one logsumexp: in a row that sees no key, the max is the mask value,
  -2.4e38, next to which float32 cannot hold log(sum).
  """
  num_q_blocks, batch, num_kv_heads, groups, block_q, _ = query.shape
  num_kv_blocks, _, _, block_kv, value_dim = value.shape
  kv_valid = _valid(num_kv_blocks, block_kv, blocks.kv_length)
  real_keys = kv_valid.sum(axis=1).astype(np.float32)  # [nk]
  # Each key block's sum of real values: what a fully masked block adds to a row's weighted sum, per unit weight.
  value_sums = jnp.einsum("NBKSH,NS->NBKH", value.astype(jnp.float32), kv_valid.astype(np.float32))
  rows = (batch, num_kv_heads, groups, block_q)

  def query_block(inputs):
    q, q_segment_ids_i, q_positions_i, q_valid = inputs

    def key_block(carry, inputs):
      m, l, acc, max_logits = carry
      k, v, kv_segment_ids_j, kv_positions_j, kv_valid_j, real_keys_j, value_sum = inputs
      visible = _visible(blocks, q_segment_ids_i, q_positions_i, q_valid, kv_segment_ids_j, kv_positions_j, kv_valid_j)

      def attend():
        _, s = _scores(blocks, q, k, visible, kv_valid_j)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("BKGTS,BKSH->BKGTH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        seen = jnp.where(visible, s, MASK_VALUE).max(axis=(0, 3, 4))
        return m_new, l * rescale + p.sum(axis=-1), acc * rescale[..., None] + pv, jnp.maximum(max_logits, seen)

      def masked():
        # Every real key of the block scores the mask value: its weight exp(MASK_VALUE - m) is 0 unless the
        # row has seen nothing else yet.
        m_new = jnp.maximum(m, MASK_VALUE)
        rescale, weight = jnp.exp(m - m_new), jnp.exp(MASK_VALUE - m_new)
        acc_new = acc * rescale[..., None] + weight[..., None] * value_sum[:, :, None, None, :]
        return m_new, l * rescale + weight * real_keys_j, acc_new, max_logits

      return jax.lax.cond(visible.any(), attend, masked), None

    if blocks.has_sinks:  # the sink joins every row's softmax first: its logit is the running max, weight 1
      m, l = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None], rows), jnp.ones(rows, jnp.float32)
    else:
      m, l = jnp.full(rows, -jnp.inf), jnp.zeros(rows, jnp.float32)
    start = (m, l, jnp.zeros((*rows, value_dim), jnp.float32), jnp.full((num_kv_heads, groups), MASK_VALUE))
    kv_inputs = (key, value, kv_segment_ids, kv_positions, kv_valid, real_keys, value_sums)
    (m, l, acc, max_logits), _ = jax.lax.scan(key_block, start, kv_inputs)
    return (acc / l[..., None]).astype(value.dtype), (m, l), max_logits

  q_valid = _valid(num_q_blocks, block_q, blocks.length)
  out, softmax_rows, max_logits = jax.lax.map(query_block, (query, q_segment_ids, q_positions, q_valid))
  return out, softmax_rows, max_logits.max(axis=0)


def _flash_backward(blocks: _Blocks, residuals, cotangents):
  """Gradients w.r.t. query, key, value and sinks from the saved output and softmax rows, scores recomputed per block.

  The max logits' cotangent is dropped: they carry no gradient, as in dot_product_attention.
  """
  query, key, value, sinks, masking, out, (row_max, row_sum) = residuals
  q_segment_ids, q_positions, kv_segment_ids, kv_positions = masking
  d_out = cotangents[0].astype(jnp.float32)
  num_q_blocks, _, _, _, block_q, _ = query.shape
  num_kv_blocks, _, _, block_kv, _ = key.shape
  # d(loss)/d(score) = p * (dp - delta), with delta = sum(d_out * out) per row: a row's gradient through its
  # softmax's denominator.
  delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)
  if blocks.has_sinks:  # a sink's weight is exp(sink - max) / sum; its logit's gradient is -weight * delta
    sink_weights = jnp.exp(sinks.astype(jnp.float32)[None, None, :, :, None] - row_max) / row_sum
    d_sinks = -jnp.sum(sink_weights * delta, axis=(0, 1, 4)).astype(sinks.dtype)
  else:
    d_sinks = jnp.zeros_like(sinks)
  q_valid = _valid(num_q_blocks, block_q, blocks.length)
  kv_valid = _valid(num_kv_blocks, block_kv, blocks.kv_length)
  cap = blocks.logits_soft_cap

  def key_block(d_query, inputs):
    k, v, kv_segment_ids_j, kv_positions_j, kv_valid_j = inputs
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)

    def query_block(carry, inputs):
      d_k, d_v = carry
      q, d_out_i, row_max_i, row_sum_i, delta_i, q_segment_ids_i, q_positions_i, q_valid_i, d_q = inputs
      visible = _visible(blocks, q_segment_ids_i, q_positions_i, q_valid_i, kv_segment_ids_j, kv_positions_j, kv_valid_j)

      def attend():
        raw, s = _scores(blocks, q, k, visible, kv_valid_j)
        p = jnp.exp(s - row_max_i[..., None]) / row_sum_i[..., None]
        d_p = jnp.einsum("BKGTH,BKSH->BKGTS", d_out_i, v)
        # Masked scores are constants (the mask value): no gradient reaches the raw scores through them.
        d_s = jnp.where(visible, p * (d_p - delta_i[..., None]), 0.0)
        if cap:
          d_s = d_s * (1.0 - jnp.square(jnp.tanh(raw / cap)))
        q32 = q.astype(jnp.float32)
        return (
            (
                d_k + jnp.einsum("BKGTS,BKGTH->BKSH", d_s, q32),
                d_v + jnp.einsum("BKGTS,BKGTH->BKSH", p, d_out_i),
            ),
            d_q + jnp.einsum("BKGTS,BKSH->BKGTH", d_s, k),
        )

      def masked():
        # Only a row that saw nothing gives these keys weight (1 / its sum); it reaches values only.
        weight = jnp.exp(MASK_VALUE - row_max_i) / row_sum_i
        d_v_rows = jnp.einsum("BKGT,BKGTH->BKH", weight, d_out_i)[:, :, None, :] * kv_valid_j[:, None]
        return (d_k, d_v + d_v_rows), d_q

      return jax.lax.cond(visible.any(), attend, masked)

    start = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    q_inputs = (query, d_out, row_max, row_sum, delta, q_segment_ids, q_positions, q_valid, d_query)
    (d_k, d_v), d_query = jax.lax.scan(query_block, start, q_inputs)
    return d_query, (d_k, d_v)

  kv_inputs = (key, value, kv_segment_ids, kv_positions, kv_valid)
  d_query, (d_key, d_value) = jax.lax.scan(key_block, jnp.zeros(query.shape, jnp.float32), kv_inputs)
  # Segment ids and positions are integers: their cotangents are float0 zeros, the only kind JAX accepts.
  no_gradient = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in masking)
  return (d_query.astype(query.dtype), d_key.astype(key.dtype), d_value.astype(value.dtype), d_sinks, *no_gradient)


_flash.defvjp(_flash_forward, _flash_backward)
