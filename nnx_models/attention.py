"""Llama self-attention: q/k/v projections, RoPE, grouped-query attention, output."""
import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge import initializers
from maxbridge.config import Config
from maxbridge.ops import attention, rotary
from nnx_models.linears import DenseGeneral


class Attention(nnx.Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    self.query = DenseGeneral(
        (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"),
        initializers.query_kernel(), **dtypes,
    )
    self.key = DenseGeneral(
        (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), **dtypes
    )
    self.value = DenseGeneral(
        (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), **dtypes
    )
    self.out = DenseGeneral(
        (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"),
        initializers.kernel(in_ndim=2), **dtypes,
    )

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    cfg = self.config
    query = self.query(x)
    key = self.key(x)
    value = self.value(x)
    query = rotary.apply_rotary(query, positions, max_timescale=cfg.rope_max_timescale)
    key = rotary.apply_rotary(key, positions, max_timescale=cfg.rope_max_timescale)
    out = attention.dot_product_attention(query, key, value, segment_ids)
    return self.out(out)
