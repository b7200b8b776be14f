"""DeepSeek-V3 decoder layers: Llama's, with MLA attention, then a dense MLP (the first
`first_num_dense_layers`) or routed + shared experts (`DeepSeekMoeBlock_0`)."""

import jax

from linen_models.attention_mla import MLA
from linen_models.llama import DecoderLayer
from linen_models.mixtral import moe_per_layer
from linen_models.moe import RoutedAndSharedMoE


class DeepSeekDenseLayer(DecoderLayer):
  attention_class = MLA


class DeepSeekMoELayer(DeepSeekDenseLayer):

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = RoutedAndSharedMoE(self.config, name="DeepSeekMoeBlock_0")(h)
    return out, moe_per_layer(loss)
