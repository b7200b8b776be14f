"""Mixtral decoder layer: Llama's, the MLP replaced by routed experts (`MoeBlock_0`)."""

import jax
from flax import nnx

from maxbridge.core.config import Config
from nnx_models.llama import DecoderLayer
from nnx_models.moe import RoutedMoE


class MixtralDecoderLayer(DecoderLayer):

  def init_feed_forward(self, config: Config, rngs: nnx.Rngs) -> None:
    self.MoeBlock_0 = RoutedMoE(config, config.mlp_dim, rngs=rngs)  # pylint: disable=invalid-name

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = self.MoeBlock_0(h)
    return out, moe_per_layer(loss)


def moe_per_layer(load_balance_loss: jax.Array | None) -> dict[str, jax.Array]:
  """A MoE layer's per-layer values: its load-balancing loss, when there is one (weight > 0)."""
  return {} if load_balance_loss is None else {"moe_lb_losses": load_balance_loss}
