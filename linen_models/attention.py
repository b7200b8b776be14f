"""Llama self-attention: q/k/v projections, RoPE, grouped-query attention, output.

Also Mistral's (sliding_window_size) and Qwen3's (use_qk_norm: per-head
RMSNorm `query_norm`/`key_norm` before RoPE; the query kernel then cannot
carry 1/sqrt(head_dim), which the norm would undo, so it is applied at run time).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.linears import dense
from linen_models.normalizations import RMSNorm
from maxbridge import initializers
from maxbridge.config import Config
from maxbridge.ops import attention, rotary


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
    query = rotary.apply_rotary(query, positions, max_timescale=cfg.rope_max_timescale)
    key = rotary.apply_rotary(key, positions, max_timescale=cfg.rope_max_timescale)
    scale = None if initializers.query_kernel_carries_scale(cfg) else head_dim**-0.5
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=cfg.sliding_window_size,
        query_scale=scale,
        with_max_logits=cfg.use_qk_clip,
    )
    return dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out")(out), per_layer
