"""Qwen3-MoE decoder layer: Llama's (with Qwen3's query/key norms, from use_qk_norm), the MLP replaced by
routed experts named as MaxText's `moe_block`."""

import jax

from linen_models.llama import DecoderLayer
from linen_models.mixtral import moe_per_layer
from linen_models.moe import RoutedMoE


class Qwen3MoeDecoderLayer(DecoderLayer):

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = RoutedMoE(self.config, self.config.moe_mlp_dim, name="moe_block")(h)
    return out, moe_per_layer(loss)
