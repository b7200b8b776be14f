"""Qwen3-MoE decoder layer: Llama's (with Qwen3's query/key norms, from use_qk_norm), the MLP replaced by
routed experts named as MaxText's `moe_block`."""

import jax
from flax import nnx

from maxbridge.core.config import Config
from nnx_models.llama import DecoderLayer
from nnx_models.mixtral import moe_per_layer
from nnx_models.moe import RoutedMoE


class Qwen3MoeDecoderLayer(DecoderLayer):

  def init_feed_forward(self, config: Config, rngs: nnx.Rngs) -> None:
    self.moe_block = RoutedMoE(config, config.moe_mlp_dim, rngs=rngs)

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = self.moe_block(h)
    return out, moe_per_layer(loss)
