"""Llama's decoder layer, which Mixtral's and DeepSeek's extend.

x + attention(norm(x)), then x + feed_forward(norm(x)). A family swaps the
attention (`attention_class`) or the feed-forward block (`init_feed_forward`,
`feed_forward`); the attributes its modules are given are their canonical
parameter paths. A layer returns (x, per-layer values): a dict the decoder
stacks over layers.
"""

from typing import ClassVar

import jax
from flax import nnx

from maxbridge.core.config import Config
from nnx_models import Module
from nnx_models.attention import Attention
from nnx_models.mlp import MlpBlock
from nnx_models.normalizations import norm


class DecoderLayer(Module):
  attention_class: ClassVar[type[nnx.Module]] = Attention

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.pre_self_attention_layer_norm = norm(config, rngs=rngs)
    self.self_attention = self.attention_class(config, rngs=rngs)
    self.post_self_attention_layer_norm = norm(config, rngs=rngs)
    self.init_feed_forward(config, rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    h = self.pre_self_attention_layer_norm(x)
    attended, attention_values = self.self_attention(h, positions, segment_ids)
    x = x + attended
    h = self.post_self_attention_layer_norm(x)
    out, per_layer = self.feed_forward(h)
    return x + out, {**attention_values, **per_layer}

  def init_feed_forward(self, config: Config, rngs: nnx.Rngs) -> None:
    self.mlp = MlpBlock(config, rngs=rngs)

  def feed_forward(self, h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return self.mlp(h), {}
