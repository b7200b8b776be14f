"""OLMo 2's decoder layer and OLMo 3's block of four: post-branch norms, QK-norm over the whole projection.

x + norm(attention(x)), then x + norm(mlp(x)): the residual stream itself is
never normalised (MaxText's Olmo3DecoderLayer names the two norms
`post_self_attention_layer_norm` and `post_mlp_layer_norm`). Queries and keys
are RMS-normalised over all their heads together, before RoPE; the query
kernel therefore cannot carry 1/sqrt(head_dim), which attention applies.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention import read_cache
from linen_models.linears import dense
from linen_models.mlp import MlpBlock
from linen_models.normalizations import norm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import olmo3
from maxbridge.ops import attention, kv_cache, normalization, rotary


class AcrossHeadsRMSNorm(nn.Module):
  """RMSNorm over a token's [heads, head_dim] together; its `scale` is flat, as Hugging Face's."""

  num_heads: int
  head_dim: int
  epsilon: float
  dtype: jnp.dtype = jnp.float32
  weight_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    partitioned = nn.with_logical_partitioning(initializers.placeholder, ("norm",))
    scale = self.param("scale", partitioned, (self.num_heads * self.head_dim,), self.weight_dtype)
    return normalization.rms_norm_across_heads(x, scale, epsilon=self.epsilon, dtype=self.dtype)


class Olmo2Attention(nn.Module):
  config: Config
  sliding_window_size: int | None = None  # this layer's window; None: the config's (0: none)

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    window = cfg.sliding_window_size if self.sliding_window_size is None else self.sliding_window_size
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), name="query")(x)
    key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="key")(x)
    value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="value")(x)
    eps = cfg.normalization_layer_epsilon
    query = AcrossHeadsRMSNorm(heads, head_dim, eps, name="query_norm", **dtypes)(query)
    key = AcrossHeadsRMSNorm(kv_heads, head_dim, eps, name="key_norm", **dtypes)(key)
    scaling = rotary.scaling_from_config(cfg)
    query = rotary.apply_rotary(query, positions, max_timescale=cfg.rope_max_timescale, scaling=scaling)
    key = rotary.apply_rotary(key, positions, max_timescale=cfg.rope_max_timescale, scaling=scaling)
    (key, value), kv, write_cache = read_cache(
        self, {"cached_key": key, "cached_value": value}, positions, segment_ids, ring=bool(kv_cache.window(cfg))
    )
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=window,
        query_scale=head_dim**-0.5,
        with_max_logits=cfg.use_qk_clip,
        **kv,
    )
    write_cache(out)
    out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out")(out)
    return attention.with_out_projection(cfg, out, per_layer)


class Olmo2DecoderLayer(nn.Module):
  config: Config
  sliding_window_size: int | None = None  # None: the config's

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    attention = Olmo2Attention(cfg, self.sliding_window_size, name="self_attention")
    attended, per_layer = attention(x, positions, segment_ids)
    x = x + norm(cfg, name="post_self_attention_layer_norm")(attended)
    out = MlpBlock(cfg, name="mlp")(x)
    return x + norm(cfg, name="post_mlp_layer_norm")(out), per_layer


class Olmo3Block(nn.Module):
  """OLMo 3's repeating unit: three sliding-window layers, then a global one (`olmo3.SUBLAYERS`).

  The decoder stacks and scans blocks, as MaxText's Olmo3ScannableBlock, so
  the alternating windows need no loop over layers.
  """

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    for name in olmo3.SUBLAYERS:
      window = 0 if name == olmo3.GLOBAL else cfg.sliding_window_size
      x, _ = Olmo2DecoderLayer(cfg, window, name=name)(x, positions, segment_ids)
    return x, {}  # no per-layer values: QK-Clip, their one source here, is refused with the QK-norm
