"""Llama 4's decoder layers (the canonical tree's layout: `maxbridge.core.families.llama4`).

A layer is Llama's (pre-norms, residuals); its attention is chunked with RoPE and
the L2 QK-norm, or (the block's last layer) NoPE, global and temperature-tuned;
its feed-forward block is a dense MLP or, as MaxText's, routed experts (`MoeBlock_0`:
`wi_0`, `wi_1`, `wo`) plus a shared one (`RoutedAndSharedMoE`). The decoder
stacks blocks of four layers (`Llama4Block`).
"""

import flax.linen as nn
import jax

from linen_models.attention import read_cache
from linen_models.linears import dense
from linen_models.mixtral import moe_per_layer
from linen_models.mlp import MlpBlock
from linen_models.moe import RoutedAndSharedMoE
from linen_models.normalizations import norm
from maxbridge.core.config import Config
from maxbridge.core.families import llama4
from maxbridge.ops import attention
from maxbridge.ops import moe as moe_ops


class Llama4Attention(nn.Module):
  """Grouped-query attention: with `rope`, rotated, L2-normed and chunked; without, global and temperature-tuned."""

  config: Config
  rope: bool = True

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), name="query")(x)
    key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="key")(x)
    value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), ("embed", "kv_heads", "kv_head_dim"), name="value")(x)
    query, key = attention.llama4_queries_keys(cfg, self.rope, query, key, positions)
    # A chunked layer's cache is a ring of one chunk (`llama4._chunk_rings`).
    new = {"cached_key": key, "cached_value": value}
    (key, value), kv, write_cache = read_cache(self, new, positions, segment_ids, ring=self.rope)
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        chunk_size=cfg.chunk_attn_window_size if self.rope else 0,
        query_scale=head_dim**-0.5,
        **kv,
    )
    write_cache(out)
    return dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out")(out), per_layer


class Llama4Layer(nn.Module):
  """x + attention(norm(x)), then x + (MLP or experts)(norm(x)), as Llama's layer names them."""

  config: Config
  rope: bool = True
  moe: bool = False

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_layer_norm")(x)
    attended, per_layer = Llama4Attention(cfg, self.rope, name="self_attention")(h, positions, segment_ids)
    x = x + attended
    h = norm(cfg, name="post_self_attention_layer_norm")(x)
    if self.moe:
      out, loss = RoutedAndSharedMoE(cfg, name="Llama4MoEBlock_0")(h)
      return x + out, {**per_layer, **moe_per_layer(loss)}
    return x + MlpBlock(cfg, name="mlp")(h), per_layer


class Llama4Block(nn.Module):
  """Three chunked RoPE layers then a NoPE one (`llama4.SUBLAYERS`): the unit the decoder stacks."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    values = []
    for i, name in enumerate(llama4.SUBLAYERS):
      layer = Llama4Layer(cfg, llama4.uses_rope(i), llama4.is_moe(cfg, i), name=name)
      x, out = layer(x, positions, segment_ids)
      values.append(out)
    return x, moe_ops.block_losses(values)
