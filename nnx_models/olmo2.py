"""OLMo 2's decoder layer and OLMo 3's block of four: post-branch norms, QK-norm over the whole projection.

x + norm(attention(x)), then x + norm(mlp(x)): the residual stream itself is
never normalised (MaxText's Olmo3DecoderLayer names the two norms
`post_self_attention_layer_norm` and `post_mlp_layer_norm`). Queries and keys
are RMS-normalised over all their heads together, before RoPE; the query
kernel therefore cannot carry 1/sqrt(head_dim), which attention applies.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import olmo3
from maxbridge.ops import attention, kv_cache, normalization, rotary
from nnx_models.attention import read_cache
from nnx_models.linears import dense
from nnx_models.mlp import MlpBlock
from nnx_models.normalizations import norm


class AcrossHeadsRMSNorm(nnx.Module):
  """RMSNorm over a token's [heads, head_dim] together; its `scale` is flat, as Hugging Face's."""

  def __init__(
      self,
      num_heads: int,
      head_dim: int,
      epsilon: float,
      dtype: jnp.dtype = jnp.float32,
      weight_dtype: jnp.dtype = jnp.float32,
      *,
      rngs: nnx.Rngs,
  ):
    shape = (num_heads * head_dim,)
    self.scale = nnx.Param(initializers.placeholder(rngs.params(), shape, weight_dtype), out_sharding=("norm",))
    self.epsilon = epsilon
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    return normalization.rms_norm_across_heads(x, self.scale[...], epsilon=self.epsilon, dtype=self.dtype)


class Olmo2Attention(nnx.Module):

  def __init__(self, config: Config, sliding_window_size: int | None = None, *, rngs: nnx.Rngs):
    cfg = self.config = config
    # This layer's window; None: the config's (0: none).
    self.window = cfg.sliding_window_size if sliding_window_size is None else sliding_window_size
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    self.query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), rngs=rngs)
    self.key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), rngs=rngs)
    self.value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), rngs=rngs)
    self.query_norm = AcrossHeadsRMSNorm(heads, head_dim, cfg.normalization_layer_epsilon, **dtypes)
    self.key_norm = AcrossHeadsRMSNorm(kv_heads, head_dim, cfg.normalization_layer_epsilon, **dtypes)
    self.out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    query = self.query_norm(self.query(x))
    key = self.key_norm(self.key(x))
    value = self.value(x)
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
        sliding_window_size=self.window,
        query_scale=cfg.head_dim**-0.5,
        with_max_logits=cfg.use_qk_clip,
        **kv,
    )
    write_cache(out)
    return attention.with_out_projection(cfg, self.out(out), per_layer)


class Olmo2DecoderLayer(nnx.Module):

  def __init__(self, config: Config, sliding_window_size: int | None = None, *, rngs: nnx.Rngs):
    self.self_attention = Olmo2Attention(config, sliding_window_size, rngs=rngs)
    self.post_self_attention_layer_norm = norm(config, rngs=rngs)
    self.mlp = MlpBlock(config, rngs=rngs)
    self.post_mlp_layer_norm = norm(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    attended, per_layer = self.self_attention(x, positions, segment_ids)
    x = x + self.post_self_attention_layer_norm(attended)
    out = self.mlp(x)
    return x + self.post_mlp_layer_norm(out), per_layer


class Olmo3Block(nnx.Module):
  """OLMo 3's repeating unit: three sliding-window layers, then a global one (`olmo3.SUBLAYERS`).

  The decoder stacks and scans blocks, as MaxText's Olmo3ScannableBlock, so
  the alternating windows need no loop over layers.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for name in olmo3.SUBLAYERS:
      window = 0 if name == olmo3.GLOBAL else config.sliding_window_size
      setattr(self, name, Olmo2DecoderLayer(config, window, rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    for name in olmo3.SUBLAYERS:
      x, _ = getattr(self, name)(x, positions, segment_ids)
    return x, {}  # no per-layer values: QK-Clip, their one source here, is refused with the QK-norm
