"""GLM-4.5's MoE decoder layer: Llama's (its attention as `glm4_moe.attention` specifies), the MLP replaced by
DeepSeek-V3's routed + shared experts (`DeepSeekMoeBlock_0`). Its dense layers are Llama's own."""

import jax
from flax import nnx

from maxbridge.core.config import Config
from nnx_models.llama import DecoderLayer
from nnx_models.mixtral import moe_per_layer
from nnx_models.moe import RoutedAndSharedMoE


class Glm4MoeDecoderLayer(DecoderLayer):

  def init_feed_forward(self, config: Config, rngs: nnx.Rngs) -> None:
    self.DeepSeekMoeBlock_0 = RoutedAndSharedMoE(config, rngs=rngs)  # pylint: disable=invalid-name

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = self.DeepSeekMoeBlock_0(h)
    return out, moe_per_layer(loss)
