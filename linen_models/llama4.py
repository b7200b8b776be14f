"""Llama 4's decoder layers (the canonical tree's layout: `maxbridge.core.families.llama4`).

A layer is Llama's (pre-norms, residuals); its attention is chunked with RoPE and
the L2 QK-norm, or (the block's last layer) NoPE, global and temperature-tuned;
its feed-forward block is a dense MLP or, as MaxText's, routed experts (`MoeBlock_0`:
`wi_0`, `wi_1`, `wo`) plus a shared one (`RoutedAndSharedMoE`). The decoder
stacks blocks of four layers (`Llama4Block`).
"""

import flax.linen as nn
import jax

from linen_models.attention import Attention
from linen_models.mixtral import moe_per_layer
from linen_models.mlp import MlpBlock
from linen_models.moe import RoutedAndSharedMoE
from linen_models.normalizations import norm
from maxbridge.core.config import Config
from maxbridge.core.families import llama4
from maxbridge.ops import moe as moe_ops


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
    attended, per_layer = Attention(cfg, self.rope, name="self_attention")(h, positions, segment_ids)
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
