"""A decode cache read before it is written (`kv_cache.read_first`, then `write`) attends as `update` did."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge.ops import attention, kv_cache

B, K, H, N, S = 2, 2, 8, 4, 12  # rows, kv heads, head dim, query heads, cache length


def empty(quantized: bool) -> dict[str, jax.Array]:
  dtype = jnp.int8 if quantized else jnp.float32
  cache = {"cached_key": jnp.zeros((B, K, H, S), dtype), "cached_value": jnp.zeros((B, K, S, H), dtype)}
  if quantized:
    cache |= {"cached_key_scale": jnp.zeros((B, K, 1, S)), "cached_value_scale": jnp.zeros((B, K, S, 1))}
  zeros = jnp.zeros((B, S), jnp.int32)
  return cache | {kv_cache.POSITIONS: zeros, kv_cache.SEGMENT_IDS: zeros, kv_cache.INDEX: jnp.zeros((B,), jnp.int32)}


def tokens(seed: int, start: int, count: int, real: int | None = None):
  """New keys and values of `count` tokens at positions start.. (the first `real` of them in segment 1)."""
  key, value = jax.random.normal(jax.random.key(seed), (2, B, count, K, H))
  positions = jnp.broadcast_to(jnp.arange(start, start + count, dtype=jnp.int32), (B, count))
  segment_ids = (jnp.arange(count) < (count if real is None else real)).astype(jnp.int32)
  return {"cached_key": key, "cached_value": value}, positions, jnp.broadcast_to(segment_ids, (B, count))


@functools.partial(jax.jit, static_argnames="ring")
def both_orders(cache, new, positions, segment_ids, ring):
  """((the cache, attention's output) with the write first, (the same) read first)."""
  query = jax.random.normal(jax.random.key(7), (B, positions.shape[1], N, H))
  mask = dict(sliding_window_size=S if ring else 0)
  written, (key, value), keywords = kv_cache.update(cache, new, positions, segment_ids, ring=ring)
  before = attention.self_attention(query, key, value, segment_ids, positions, **mask, **keywords)[0]
  (key, value), keywords = kv_cache.read_first(cache, new, positions, segment_ids, ring=ring)
  after = attention.self_attention(query, key, value, segment_ids, positions, **mask, **keywords)[0]
  return (written, before), (kv_cache.write(cache, new, positions, segment_ids, ring=ring, after=after), after)


@pytest.mark.parametrize(  # a decode step and a chunk (the last token padding), each kind of cache once
    "ring, steps, quantized", [(False, 1, False), (False, 3, True), (True, 1, True), (True, 3, False)]
)
def test_reading_before_the_write_attends_as_after_it_and_writes_the_same_cache(quantized, ring, steps):
  cache = kv_cache.ring_append(empty(quantized), *tokens(0, 0, 10)) if ring else empty(quantized)
  if not ring:  # a prompt, then 4 drafts of which 1 is kept: the index rewound over real entries, as speculation's
    cache = kv_cache.append(cache, *tokens(0, 0, 6))
    cache = kv_cache.append(cache, *tokens(1, 6, 4)) | {kv_cache.INDEX: jnp.full((B,), 7, jnp.int32)}
  start = 10 if ring else 7
  (written, before), (rewritten, after) = both_orders(cache, *tokens(2, start, steps, real=steps - 1 or 1), ring=ring)
  np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, rewritten, written)


def test_a_stale_entry_where_the_write_lands_is_not_seen():
  # The index rewound over a real entry at the new token's own position: read first, it must stay unseen.
  cache = kv_cache.append(empty(False), *tokens(0, 0, 5)) | {kv_cache.INDEX: jnp.full((B,), 4, jnp.int32)}
  new, positions, segment_ids = tokens(3, 4, 1)
  (key, value), keywords = kv_cache.read_first(cache, new, positions, segment_ids)
  assert [block.shape[1] for block in key] == [S, 1]
  np.testing.assert_array_equal(keywords["kv_segment_ids"][:, 4], kv_cache.REPLACED)
  np.testing.assert_array_equal(keywords["kv_segment_ids"][:, [0, 3, S]], 1)
  np.testing.assert_array_equal(keywords["kv_segment_ids"][:, 5], 0)
  (_, before), (_, after) = both_orders(cache, new, positions, segment_ids, ring=False)
  np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
