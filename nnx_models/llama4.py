"""Llama 4's decoder layers (the canonical tree's layout: `maxbridge.core.families.llama4`).

A layer is Llama's (pre-norms, residuals); its attention is chunked with RoPE and
the L2 QK-norm, or (the block's last layer) NoPE, global and temperature-tuned;
its feed-forward block is a dense MLP or, as MaxText's, routed experts (`MoeBlock_0`:
`wi_0`, `wi_1`, `wo`) plus a shared one (`RoutedAndSharedMoE`). The decoder
stacks blocks of four layers (`Llama4Block`).
"""

import jax
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.core.families import llama4
from maxbridge.ops import attention
from maxbridge.ops import moe as moe_ops
from nnx_models.attention import read_cache
from nnx_models.linears import dense
from nnx_models.mixtral import moe_per_layer
from nnx_models.mlp import MlpBlock
from nnx_models.moe import RoutedAndSharedMoE
from nnx_models.normalizations import norm


class Llama4Attention(nnx.Module):
  """Grouped-query attention: with `rope`, rotated, L2-normed and chunked; without, global and temperature-tuned."""

  def __init__(self, config: Config, rope: bool = True, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.rope = rope
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    self.query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), rngs=rngs)
    self.key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), rngs=rngs)
    self.value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), rngs=rngs)
    self.out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    query, key = attention.llama4_queries_keys(cfg, self.rope, self.query(x), self.key(x), positions)
    # A chunked layer's cache is a ring of one chunk (`llama4._chunk_rings`).
    new = {"cached_key": key, "cached_value": self.value(x)}
    (key, value), kv, write_cache = read_cache(self, new, positions, segment_ids, ring=self.rope)
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        chunk_size=cfg.chunk_attn_window_size if self.rope else 0,
        query_scale=cfg.head_dim**-0.5,
        **kv,
    )
    write_cache(out)
    return self.out(out), per_layer


class Llama4Layer(nnx.Module):
  """x + attention(norm(x)), then x + (MLP or experts)(norm(x)), as Llama's layer names them."""

  def __init__(self, config: Config, rope: bool = True, moe: bool = False, *, rngs: nnx.Rngs):
    self.moe = moe
    self.pre_self_attention_layer_norm = norm(config, rngs=rngs)
    self.self_attention = Llama4Attention(config, rope, rngs=rngs)
    self.post_self_attention_layer_norm = norm(config, rngs=rngs)
    if moe:
      self.Llama4MoEBlock_0 = RoutedAndSharedMoE(config, rngs=rngs)  # pylint: disable=invalid-name
    else:
      self.mlp = MlpBlock(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    attended, per_layer = self.self_attention(self.pre_self_attention_layer_norm(x), positions, segment_ids)
    x = x + attended
    h = self.post_self_attention_layer_norm(x)
    if self.moe:
      out, loss = self.Llama4MoEBlock_0(h)
      return x + out, {**per_layer, **moe_per_layer(loss)}
    return x + self.mlp(h), per_layer


class Llama4Block(nnx.Module):
  """Three chunked RoPE layers then a NoPE one (`llama4.SUBLAYERS`): the unit the decoder stacks."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for i, name in enumerate(llama4.SUBLAYERS):
      setattr(self, name, Llama4Layer(config, llama4.uses_rope(i), llama4.is_moe(config, i), rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    values = []
    for name in llama4.SUBLAYERS:
      x, out = getattr(self, name)(x, positions, segment_ids)
      values.append(out)
    return x, moe_ops.block_losses(values)
