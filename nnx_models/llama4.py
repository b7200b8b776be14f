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
from maxbridge.ops import moe as moe_ops
from nnx_models import Module
from nnx_models.attention import Attention
from nnx_models.mixtral import moe_per_layer
from nnx_models.mlp import MlpBlock
from nnx_models.moe import RoutedAndSharedMoE
from nnx_models.normalizations import norm


class Llama4Layer(Module):
  """x + attention(norm(x)), then x + (MLP or experts)(norm(x)), as Llama's layer names them."""

  def __init__(self, config: Config, rope: bool = True, moe: bool = False, *, rngs: nnx.Rngs):
    self.moe = moe
    self.pre_self_attention_layer_norm = norm(config, rngs=rngs)
    self.self_attention = Attention(config, rope, rngs=rngs)
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


class Llama4Block(Module):
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
