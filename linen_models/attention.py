"""Llama self-attention: q/k/v projections, RoPE, grouped-query attention, output.

Also Mistral's (sliding_window_size) and Qwen3's (use_qk_norm: per-head
RMSNorm `query_norm`/`key_norm` before RoPE; the query kernel then cannot
carry 1/sqrt(head_dim), which the norm would undo, so it is applied at run time).

Decoding: given a "cache" collection (`maxbridge.models.decoding`), attention reads
it and its new keys and values, then appends those (`read_cache`); training
never passes one, so no layer ever creates a cache.
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.linears import dense
from linen_models.normalizations import RMSNorm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import attention, kv_cache, rotary


class Attention(nn.Module):
  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(output, per-layer values: the per-head max logits when QK-Clip is on)."""
    cfg = self.config
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), name="query")(x)
    key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="key")(x)
    value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="value")(x)
    if cfg.use_qk_norm:
      norm = dict(epsilon=cfg.normalization_layer_epsilon, **dtypes)
      query = RMSNorm(head_dim, name="query_norm", **norm)(query)
      key = RMSNorm(head_dim, name="key_norm", **norm)(key)
    query = rotary.apply_rotary(
        query, positions, max_timescale=cfg.rope_max_timescale, scaling=rotary.scaling_from_config(cfg)
    )
    key = rotary.apply_rotary(
        key, positions, max_timescale=cfg.rope_max_timescale, scaling=rotary.scaling_from_config(cfg)
    )
    scale = None if initializers.query_kernel_carries_scale(cfg) else head_dim**-0.5
    (key, value), kv, write_cache = read_cache(
        self, {"cached_key": key, "cached_value": value}, positions, segment_ids, ring=bool(kv_cache.window(cfg))
    )
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=cfg.sliding_window_size,
        query_scale=scale,
        with_max_logits=cfg.use_qk_clip,
        **kv,
    )
    write_cache(out)
    out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out")(out)
    return attention.with_out_projection(cfg, out, per_layer)


def update_cache(
    module: nn.Module, new: dict[str, jax.Array], positions: jax.Array, segment_ids: jax.Array, *, ring: bool = False
) -> tuple[tuple[jax.Array, ...], dict[str, jax.Array]]:
  """(what attention reads for each of `new`'s entries, in order; the keyword arguments masking that read).

  While decoding, appends `new` ({name: [B, T, ...]}) to `module`'s cache and
  reads all of it (`ops.kv_cache.update`; `ring` for a windowed layer's ring);
  else `new`'s own values and no keywords. Layers use `read_cache`, which
  reads before it writes; only Gemma 4's keep this order, since its KV-shared
  layers attend over an earlier layer's keys and values, and a write deferred
  past those reads would have to follow every one of them.
  """
  if not module.has_variable("cache", kv_cache.INDEX):
    return tuple(new.values()), {}
  names = kv_cache.stored_names(new, lambda name: module.has_variable("cache", name))
  cache, values, keywords = kv_cache.update(
      {name: module.get_variable("cache", name) for name in names}, new, positions, segment_ids, ring=ring
  )
  for name, value in cache.items():
    module.put_variable("cache", name, value)
  return values, keywords


def read_cache(
    module: nn.Module, new: dict[str, jax.Array], positions: jax.Array, segment_ids: jax.Array, *, ring: bool = False
) -> tuple[tuple[tuple[jax.Array, ...], ...], dict[str, jax.Array], Callable[[jax.Array], None]]:
  """`update_cache`'s reads, its write deferred: (values, keywords, `write`), `write(out)` called with
  attention's output once it is computed.

  Each value is a tuple of blocks that attention reads as one sequence
  (`ops.attention.dot_product_attention`). While decoding, two: the cache's
  as it lies and `new`'s (`ops.kv_cache.read_first`); `write` then stores
  `new` after the read (`ops.kv_cache.write`), so XLA never copies a layer's
  cache to keep the read from the write. Else one, `new`'s own, no keywords,
  and a `write` that does nothing. Not for a cache that another layer reads
  too (Gemma 4's KV sharing): that read would follow the write.
  """
  if not module.has_variable("cache", kv_cache.INDEX):
    return tuple((values,) for values in new.values()), {}, lambda out: None
  names = kv_cache.stored_names(new, lambda name: module.has_variable("cache", name))
  cache = {name: module.get_variable("cache", name) for name in names}
  values, keywords = kv_cache.read_first(cache, new, positions, segment_ids, ring=ring)

  def write(out: jax.Array) -> None:
    for name, value in kv_cache.write(cache, new, positions, segment_ids, ring=ring, after=out).items():
      module.put_variable("cache", name, value)

  return values, keywords, write
