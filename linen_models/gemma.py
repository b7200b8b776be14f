"""Gemma 1's and Gemma 2's decoder layers (the canonical tree's layout: `maxbridge.core.families.gemma`).

Gemma 1 is Llama's layer with a GeGLU MLP, by MaxText's names (`pre_self_attention_norm`,
`pre_ffw_norm`). A Gemma 2 layer normalises each branch's input and output
(`pre_/post_self_attention_norm`, `pre_/post_ffw_norm`) and soft-caps its attention
logits; a stacked Gemma 2 layer is a block of a sliding-window layer (`local`) and a
global one (`global`), as MaxText scans them.
"""

import flax.linen as nn
import jax

from linen_models.attention import update_cache
from linen_models.linears import dense
from linen_models.normalizations import norm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import attention, kv_cache, mlp, rotary


class GeGluBlock(nn.Module):
  """wo(gelu_tanh(wi_0 x) * wi_1 x)."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    gate = dense(cfg, (cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), name="wi_0")(x)
    up = dense(cfg, (cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), name="wi_1")(x)
    return dense(cfg, (cfg.mlp_dim,), (cfg.emb_dim,), ("mlp", "embed"), name="wo")(mlp.gelu_gate(gate, up))


class GemmaDecoderLayer(nn.Module):
  """Gemma 1: x + attention(norm(x)), then x + mlp(norm(x)) (MaxText's names; (1 + w) held in the norm scales)."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_norm")(x)
    h, per_layer = GemmaAttention(cfg, name="self_attention")(h, positions, segment_ids)
    x = x + h
    return x + GeGluBlock(cfg, name="mlp")(norm(cfg, name="pre_ffw_norm")(x)), per_layer


class GemmaAttention(nn.Module):
  """Grouped-query attention with soft-capped logits and this layer's own window (0: global)."""

  config: Config
  sliding_window_size: int = 0

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), name="query")(x)
    key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="key")(x)
    value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="value")(x)
    rope = dict(max_timescale=cfg.rope_max_timescale, scaling=rotary.scaling_from_config(cfg))
    query = rotary.apply_rotary(query, positions, **rope)
    key = rotary.apply_rotary(key, positions, **rope)
    (key, value), kv = update_cache(
        self, {"cached_key": key, "cached_value": value}, positions, segment_ids, ring=bool(kv_cache.window(cfg))
    )
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=self.sliding_window_size,
        query_scale=None if initializers.query_kernel_carries_scale(cfg) else head_dim**-0.5,
        with_max_logits=cfg.use_qk_clip,
        logits_soft_cap=cfg.attn_logits_soft_cap,
        **kv,
    )
    return dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out")(out), per_layer


class Gemma2Layer(nn.Module):
  """x + norm(attention(norm(x))), then x + norm(mlp(norm(x)))."""

  config: Config
  sliding_window_size: int = 0

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_norm")(x)
    h, per_layer = GemmaAttention(cfg, self.sliding_window_size, name="self_attention")(h, positions, segment_ids)
    x = x + norm(cfg, name="post_self_attention_norm")(h)
    h = GeGluBlock(cfg, name="mlp")(norm(cfg, name="pre_ffw_norm")(x))
    return x + norm(cfg, name="post_ffw_norm")(h), per_layer


class Gemma2Block(nn.Module):
  """A sliding-window layer then a global one: the unit the decoder stacks (`Stack.sublayers`)."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    x, _ = Gemma2Layer(cfg, cfg.sliding_window_size, name="local")(x, positions, segment_ids)
    x, _ = Gemma2Layer(cfg, 0, name="global")(x, positions, segment_ids)
    return x, {}
