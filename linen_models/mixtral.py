"""Mixtral decoder layer: Llama's, the MLP replaced by routed experts (`MoeBlock_0`)."""

import jax

from linen_models.llama import DecoderLayer
from linen_models.moe import RoutedMoE


class MixtralDecoderLayer(DecoderLayer):

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = RoutedMoE(self.config, self.config.mlp_dim, name="MoeBlock_0")(h)
    return out, moe_per_layer(loss)


def moe_per_layer(load_balance_loss: jax.Array | None) -> dict[str, jax.Array]:
  """A MoE layer's per-layer values: its load-balancing loss, when there is one (weight > 0)."""
  return {} if load_balance_loss is None else {"moe_lb_losses": load_balance_loss}
