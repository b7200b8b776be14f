"""DeepSeek's multi-head latent attention, named as MaxText's MLA.

Queries: `query`, or with `q_lora_rank` > 0 the low-rank path `wq_a` -> `q_norm`
-> `wq_b`. Keys and values: `wkv_a` to a latent (plus one shared rope key part),
`kv_norm`, `wkv_b` up to every head's [key nope | value]. `wq_b` and `wkv_b`
are whole kernels [rank, heads, dims], as QK-Clip needs them. The softmax
scale 1/sqrt(nope + rope) (with YaRN, times mscale^2: `ops.mla.softmax_scale`) is applied at
run time (as MaxText and Hugging Face do); YaRN's frequencies turn the rope parts (`ops.mla.rope`).
The latent norms keep DeepSeek's own epsilon (`ops.mla.LATENT_NORM_EPSILON`).
A decode cache keeps the normed latent and the rotated rope key, not the
expanded keys and values; every read expands the whole cache with `wkv_b`.
With `use_indexer` (DeepSeek-V3.2) an `Indexer` picks the keys each query
reads (`ops.indexer`); its own keys are cached beside the latent.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import attention, indexer, mla
from nnx_models import Module
from nnx_models.attention import read_cache
from nnx_models.linears import dense
from nnx_models.normalizations import LayerNorm, RMSNorm


class Indexer(Module):
  """DeepSeek-V3.2's lightning indexer, named as transformers' (`wq_b`, `wk`, `k_norm`, `weights_proj`): its
  queries from MLA's normed low-rank query, one key per token; `keys` returns them, `__call__` scores them."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    heads, head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
    self.wq_b = dense(cfg, (cfg.q_lora_rank,), (heads, head_dim), ("q_lora", "q_heads", "kv"), rngs=rngs)
    self.wk = dense(cfg, (cfg.emb_dim,), (head_dim,), ("embed", "kv"), rngs=rngs)
    self.k_norm = LayerNorm(
        head_dim, mla.LATENT_NORM_EPSILON, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype), rngs=rngs
    )
    self.weights_proj = dense(cfg, (cfg.emb_dim,), (heads,), ("embed", "q_heads"), rngs=rngs)

  def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, emb] -> the rotated keys [B, T, D] (what a decode cache keeps)."""
    return indexer.rope(self.k_norm(self.wk(x))[:, :, None], positions, self.config)[:, :, 0]

  def __call__(self, x: jax.Array, low_rank_query: jax.Array, positions: jax.Array, keys) -> jax.Array:
    """Scores [B, T, S] of the queries of `x` against the key blocks `keys`."""
    query = indexer.rope(self.wq_b(low_rank_query), positions, self.config)
    return indexer.scores(query, keys, self.weights_proj(x))


class MLA(Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    eps = mla.LATENT_NORM_EPSILON
    heads = cfg.num_query_heads
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank == 0:
      self.query = dense(cfg, (cfg.emb_dim,), (heads, qk_head_dim), ("embed", "q_heads", "kv"), rngs=rngs)
    else:
      self.wq_a = dense(cfg, (cfg.emb_dim,), (cfg.q_lora_rank,), ("embed", "q_lora_up_proj"), rngs=rngs)
      self.q_norm = RMSNorm(cfg.q_lora_rank, eps, **dtypes)
      self.wq_b = dense(cfg, (cfg.q_lora_rank,), (heads, qk_head_dim), ("q_lora", "q_heads", "kv"), rngs=rngs)
    latent_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    self.wkv_a = dense(cfg, (cfg.emb_dim,), (latent_dim,), ("embed", "kv_lora_up_proj"), rngs=rngs)
    self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps, **dtypes)
    key_value_dim = cfg.qk_nope_head_dim + cfg.v_head_dim
    self.wkv_b = dense(
        cfg, (cfg.kv_lora_rank,), (heads, key_value_dim), ("kv_lora", "kv_heads", "kv_head_dim"), rngs=rngs
    )
    self.out = dense(cfg, (heads, cfg.v_head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), rngs=rngs)
    if cfg.use_indexer:
      self.indexer = Indexer(cfg, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(output, per-layer values: the per-head max logits when QK-Clip is on)."""
    cfg = self.config
    if cfg.q_lora_rank == 0:
      query = self.query(x)
    else:
      low_rank = self.q_norm(self.wq_a(x))
      query = self.wq_b(low_rank)
    query = mla.rope_query(query, positions, nope_dim=cfg.qk_nope_head_dim, **mla.rope(cfg))
    latent, key_rope = jnp.split(self.wkv_a(x), [cfg.kv_lora_rank], axis=-1)
    latent = self.kv_norm(latent)
    key_rope = mla.rope_key(key_rope, positions, **mla.rope(cfg))
    new = {"cached_latent": latent, "cached_key_rope": key_rope}
    if cfg.use_indexer:
      new["cached_index_key"] = self.indexer.keys(x, positions)
    cached, kv, write_cache = read_cache(self, new, positions, segment_ids)
    latent, key_rope = cached[:2]
    # Each block (a decode cache's, the new tokens') expanded where it lies.
    blocks = [
        mla.latent_key_value(self.wkv_b(part), rope, nope_dim=cfg.qk_nope_head_dim)
        for part, rope in zip(latent, key_rope)
    ]
    key, value = zip(*blocks)
    scale = None if initializers.query_kernel_carries_scale(cfg) else mla.softmax_scale(cfg)
    key_mask = None
    if cfg.use_indexer:
      index_scores = self.indexer(x, low_rank, positions, cached[2])
      key_mask = indexer.chosen_keys(index_scores, positions, segment_ids, kv, cfg.indexer_topk)
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        query_scale=scale,
        with_max_logits=cfg.use_qk_clip,
        **attention.kernel_options(cfg),
        **kv,
        key_mask=key_mask,
    )
    write_cache(out)
    return attention.with_out_projection(cfg, self.out(out), per_layer)
