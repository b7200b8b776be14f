"""GLM-4.5's MoE decoder layer: Llama's (its attention as `glm4_moe.attention` specifies), the MLP replaced by
DeepSeek-V3's routed + shared experts (`DeepSeekMoeBlock_0`). Its dense layers are Llama's own."""

import jax

from linen_models.llama import DecoderLayer
from linen_models.mixtral import moe_per_layer
from linen_models.moe import RoutedAndSharedMoE


class Glm4MoeDecoderLayer(DecoderLayer):

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = RoutedAndSharedMoE(self.config, name="DeepSeekMoeBlock_0")(h)
    return out, moe_per_layer(loss)
