"""OLMo 2's decoder layer and OLMo 3's block of four: post-branch norms, QK-norm over the whole projection.

x + norm(attention(x)), then x + norm(mlp(x)): the residual stream itself is
never normalised (MaxText's Olmo3DecoderLayer names the two norms
`post_self_attention_layer_norm` and `post_mlp_layer_norm`). Queries and keys
are RMS-normalised over all their heads together, before RoPE; the query
kernel therefore cannot carry 1/sqrt(head_dim), which attention applies.
"""

import jax
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.core.families import olmo3
from nnx_models import Module
from nnx_models.attention import Attention
from nnx_models.mlp import MlpBlock
from nnx_models.normalizations import norm


class Olmo2DecoderLayer(Module):

  def __init__(self, config: Config, local: bool = False, *, rngs: nnx.Rngs):
    self.self_attention = Attention(config, local, rngs=rngs)  # local: OLMo 3's sliding-window layers
    self.post_self_attention_layer_norm = norm(config, rngs=rngs)
    self.mlp = MlpBlock(config, rngs=rngs)
    self.post_mlp_layer_norm = norm(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    attended, per_layer = self.self_attention(x, positions, segment_ids)
    x = x + self.post_self_attention_layer_norm(attended)
    out = self.mlp(x)
    return x + self.post_mlp_layer_norm(out), per_layer


class Olmo3Block(Module):
  """OLMo 3's repeating unit: three sliding-window layers, then a global one (`olmo3.SUBLAYERS`).

  The decoder stacks and scans blocks, as MaxText's Olmo3ScannableBlock, so
  the alternating windows need no loop over layers.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for name in olmo3.SUBLAYERS:
      setattr(self, name, Olmo2DecoderLayer(config, name != olmo3.GLOBAL, rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    for name in olmo3.SUBLAYERS:
      x, _ = getattr(self, name)(x, positions, segment_ids)
    return x, {}  # no per-layer values: QK-Clip, their one source here, is refused with the QK-norm
