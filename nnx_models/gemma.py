"""Gemma 1's and Gemma 2's decoder layers (the canonical tree's layout: `maxbridge.core.families.gemma`).

Gemma 1 is Llama's layer with a GeGLU MLP, by MaxText's names (`pre_self_attention_norm`,
`pre_ffw_norm`). A Gemma 2 layer normalises each branch's input and output
(`pre_/post_self_attention_norm`, `pre_/post_ffw_norm`) and soft-caps its attention
logits; a stacked Gemma 2 layer is a block of a sliding-window layer (`local`) and a
global one (`global`), as MaxText scans them.
"""

import jax
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import attention, kv_cache, mlp, rotary
from nnx_models.attention import update_cache
from nnx_models.linears import dense
from nnx_models.normalizations import norm


class GeGluBlock(nnx.Module):
  """wo(gelu_tanh(wi_0 x) * wi_1 x)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    self.wi_0 = dense(cfg, (cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), rngs=rngs)
    self.wi_1 = dense(cfg, (cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), rngs=rngs)
    self.wo = dense(cfg, (cfg.mlp_dim,), (cfg.emb_dim,), ("mlp", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.wo(mlp.gelu_gate(self.wi_0(x), self.wi_1(x)))


class GemmaDecoderLayer(nnx.Module):
  """Gemma 1: x + attention(norm(x)), then x + mlp(norm(x)) (MaxText's names; (1 + w) held in the norm scales)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.pre_self_attention_norm = norm(config, rngs=rngs)
    self.self_attention = GemmaAttention(config, rngs=rngs)
    self.pre_ffw_norm = norm(config, rngs=rngs)
    self.mlp = GeGluBlock(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    h, per_layer = self.self_attention(self.pre_self_attention_norm(x), positions, segment_ids)
    x = x + h
    return x + self.mlp(self.pre_ffw_norm(x)), per_layer


class GemmaAttention(nnx.Module):
  """Grouped-query attention with soft-capped logits and this layer's own window (0: global)."""

  def __init__(self, config: Config, sliding_window_size: int = 0, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.sliding_window_size = sliding_window_size
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    self.query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), rngs=rngs)
    self.key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), rngs=rngs)
    self.value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), rngs=rngs)
    self.out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    rope = dict(max_timescale=cfg.rope_max_timescale, scaling=rotary.scaling_from_config(cfg))
    query = rotary.apply_rotary(self.query(x), positions, **rope)
    key = rotary.apply_rotary(self.key(x), positions, **rope)
    (key, value), kv = update_cache(
        self,
        {"cached_key": key, "cached_value": self.value(x)},
        positions,
        segment_ids,
        ring=bool(kv_cache.window(cfg)),
    )
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=self.sliding_window_size,
        query_scale=None if initializers.query_kernel_carries_scale(cfg) else cfg.head_dim**-0.5,
        with_max_logits=cfg.use_qk_clip,
        logits_soft_cap=cfg.attn_logits_soft_cap,
        **kv,
    )
    return self.out(out), per_layer


class Gemma2Layer(nnx.Module):
  """x + norm(attention(norm(x))), then x + norm(mlp(norm(x)))."""

  def __init__(self, config: Config, sliding_window_size: int = 0, *, rngs: nnx.Rngs):
    self.pre_self_attention_norm = norm(config, rngs=rngs)
    self.self_attention = GemmaAttention(config, sliding_window_size, rngs=rngs)
    self.post_self_attention_norm = norm(config, rngs=rngs)
    self.pre_ffw_norm = norm(config, rngs=rngs)
    self.mlp = GeGluBlock(config, rngs=rngs)
    self.post_ffw_norm = norm(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    h, per_layer = self.self_attention(self.pre_self_attention_norm(x), positions, segment_ids)
    x = x + self.post_self_attention_norm(h)
    h = self.mlp(self.pre_ffw_norm(x))
    return x + self.post_ffw_norm(h), per_layer


class Gemma2Block(nnx.Module):
  """A sliding-window layer then a global one: the unit the decoder stacks (`Stack.sublayers`)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.local = Gemma2Layer(config, config.sliding_window_size, rngs=rngs)
    # `global` is a Python keyword: set by name, so the canonical path reads `layers/global`.
    setattr(self, "global", Gemma2Layer(config, 0, rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    x, _ = self.local(x, positions, segment_ids)
    x, _ = getattr(self, "global")(x, positions, segment_ids)
    return x, {}
