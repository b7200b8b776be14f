"""DeepSeek-V3 decoder layers: Llama's, with MLA attention, then a dense MLP (the first
`first_num_dense_layers`) or routed + shared experts (`DeepSeekMoeBlock_0`)."""

import jax
from flax import nnx

from maxbridge.core.config import Config
from nnx_models.attention_mla import MLA
from nnx_models.llama import DecoderLayer
from nnx_models.mixtral import moe_per_layer
from nnx_models.moe import RoutedAndSharedMoE


class DeepSeekDenseLayer(DecoderLayer):
  attention_class = MLA


class DeepSeekMoELayer(DeepSeekDenseLayer):

  def init_feed_forward(self, config: Config, rngs: nnx.Rngs) -> None:
    self.DeepSeekMoeBlock_0 = RoutedAndSharedMoE(config, rngs=rngs)  # pylint: disable=invalid-name

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    out, loss = self.DeepSeekMoeBlock_0(h)
    return out, moe_per_layer(loss)
