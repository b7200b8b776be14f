"""Self-attention, one layer for every family whose parameters are its `query`, `key`, `value` and `out`.

What differs by family and kind of layer is data: the family entry's
`AttentionSpec` (`maxbridge.core.families.attention`: biases, sinks, QK-norm,
RoPE kind, window or chunk, query scale, soft cap, output gate, shared keys and
values). The chain is always: projections, QK-norm, RoPE (`ops.attention.turn`),
the decode cache, `ops.attention.self_attention`, the output gate, the out
projection. GPT-3's fused `qkv_proj` and DeepSeek's MLA build their own
projections and share the rest (`attend`).

Decoding: given a "cache" collection (`maxbridge.models.decoding`), attention reads
it and its new keys and values, then appends those (`read_cache`); training
never passes one, so no layer ever creates a cache.
"""

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.linears import dense
from linen_models.normalizations import AcrossHeadsRMSNorm, RMSNorm, ZeroCentredRMSNorm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import attention as spec_kinds
from maxbridge.core.families.attention import AttentionSpec
from maxbridge.ops import attention, kv_cache, normalization

_QK_NORMS = {
    spec_kinds.RMS_NORM: RMSNorm,
    spec_kinds.ZERO_CENTRED_RMS_NORM: ZeroCentredRMSNorm,
    spec_kinds.ACROSS_HEADS: AcrossHeadsRMSNorm,
}


class Attention(nn.Module):
  """The family's attention for a `local` (sliding-window or chunked) or full layer; a `kv_shared` layer has no
  key/value weights and attends over the `shared_kv` it is given (`Family.attention`)."""

  config: Config
  local: bool = False
  kv_shared: bool = False

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array,
      shared_kv: attention.SharedKV | None = None,
  ) -> tuple[jax.Array, dict]:
    """(output, per-layer values: `attend`'s, and the out projection's output for feature distillation)."""
    cfg = self.config
    spec = cfg.family.attention(cfg, local=self.local, kv_shared=self.kv_shared)
    heads, head_dim = cfg.num_query_heads, spec.head_dim
    biased = dict(use_bias=spec.qkv_bias)
    query_width = 2 * head_dim if spec.output_gate else head_dim
    query = dense(cfg, (cfg.emb_dim,), (heads, query_width), ("embed", "q_heads", "kv"), name="query", **biased)(x)
    if spec.output_gate:
      query, gate = jnp.split(query, 2, axis=-1)
    query = _qk_norm(cfg, spec, heads, "query_norm", query)
    masking = None
    if spec.kv == spec_kinds.SHARED_KV:
      query, _ = attention.turn(spec, cfg, query, None, positions)
      key, value, masking = shared_kv  # turned, normed and cached by the layer that made them
    else:
      kv_axes = ("embed", "kv_heads", "kv_head_dim")
      key = dense(cfg, (cfg.emb_dim,), (spec.kv_heads, head_dim), kv_axes, name="key", **biased)(x)
      if spec.kv == spec_kinds.VALUE_IS_KEY:
        value = key  # before the key's norm and RoPE
      else:
        value = dense(cfg, (cfg.emb_dim,), (spec.kv_heads, head_dim), kv_axes, name="value", **biased)(x)
      query, key = attention.turn(spec, cfg, query, _qk_norm(cfg, spec, spec.kv_heads, "key_norm", key), positions)
      if spec.value_norm:  # without a scale
        eps, dtype = cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype)
        value = normalization.rms_norm(value, jnp.ones((head_dim,)), epsilon=eps, dtype=dtype)
    sinks = None
    if spec.sinks:
      partitioned = nn.with_logical_partitioning(initializers.placeholder, ("heads",))
      sinks = self.param("sinks", partitioned, (heads,), jnp.dtype(cfg.weight_dtype))
    out, values = attend(self, cfg, spec, query, key, value, positions, segment_ids, sinks=sinks, masking=masking)
    if spec.output_gate:
      out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out", use_bias=spec.out_bias)(out)
    return attention.with_out_projection(cfg, out, values)


def _qk_norm(config: Config, spec: AttentionSpec, heads: int, name: str, x: jax.Array) -> jax.Array:
  """`x` [B, T, heads, head_dim] through the spec's learned QK-norm, named `name`; as it is without one."""
  if spec.qk_norm not in _QK_NORMS:
    return x
  width = heads * spec.head_dim if spec.qk_norm == spec_kinds.ACROSS_HEADS else spec.head_dim
  dtypes = dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype))
  return _QK_NORMS[spec.qk_norm](width, config.normalization_layer_epsilon, name=name, **dtypes)(x)


def attend(
    module: nn.Module,
    config: Config,
    spec: AttentionSpec,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    sinks: jax.Array | None = None,
    masking: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, dict]:
  """Turned queries, keys and values -> (attention's output before the out projection, per-layer values).

  Reads and writes `module`'s decode cache when it has one (`read_cache`; for a
  layer that shares its keys and values, `update_cache`, and the values then
  hold what it attended over, `ops.attention.ATTENDED`). `masking`: given
  for the keys and values of an earlier layer (the keywords that mask its
  read), which this layer neither caches nor writes. The values hold the per-head max logits
  when QK-Clip is on.
  """
  write_cache = lambda out: None  # noqa: E731
  if masking is not None:
    kv = masking
  elif spec.shares_kv:
    (key, value), kv = update_cache(
        module, {"cached_key": key, "cached_value": value}, positions, segment_ids, ring=spec.ring_cache
    )
  else:
    (key, value), kv, write_cache = read_cache(
        module, {"cached_key": key, "cached_value": value}, positions, segment_ids, ring=spec.ring_cache
    )
  out, values = attention.layer_attention(spec, config, query, key, value, segment_ids, positions, sinks=sinks, **kv)
  write_cache(out)
  if spec.shares_kv and masking is None:
    values = {**values, attention.ATTENDED: (key, value, kv)}
  return out, values


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
