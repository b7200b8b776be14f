"""Llama's decoder layer, which Mixtral's and DeepSeek's extend.

x + attention(norm(x)), then x + feed_forward(norm(x)). A family swaps the
attention (`attention_class`) or the feed-forward block (`feed_forward`); the
names its modules are given are their canonical parameter paths. A layer
returns (x, per-layer values): a dict the decoder stacks over layers.
"""

from typing import ClassVar

import flax.linen as nn
import jax

from linen_models.attention import Attention
from linen_models.mlp import MlpBlock
from linen_models.normalizations import norm
from maxbridge.core.config import Config


class DecoderLayer(nn.Module):
  config: Config
  attention_class: ClassVar[type[nn.Module]] = Attention

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_layer_norm")(x)
    attended, attention_values = self.attention_class(cfg, name="self_attention")(h, positions, segment_ids)
    x = x + attended
    h = norm(cfg, name="post_self_attention_layer_norm")(x)
    out, per_layer = self.feed_forward(h)
    return x + out, {**attention_values, **per_layer}  # (carry, output), the form nn.scan drives

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    # Called from the compact __call__, so the modules made here are this layer's.
    return MlpBlock(self.config, name="mlp")(h), {}
