"""OLMo 2's decoder layer and OLMo 3's block of four: post-branch norms, QK-norm over the whole projection.

x + norm(attention(x)), then x + norm(mlp(x)): the residual stream itself is
never normalised (MaxText's Olmo3DecoderLayer names the two norms
`post_self_attention_layer_norm` and `post_mlp_layer_norm`). Queries and keys
are RMS-normalised over all their heads together, before RoPE; the query
kernel therefore cannot carry 1/sqrt(head_dim), which attention applies.
"""

import flax.linen as nn
import jax

from linen_models.attention import Attention
from linen_models.mlp import MlpBlock
from linen_models.normalizations import norm
from maxbridge.core.config import Config
from maxbridge.core.families import olmo3


class Olmo2DecoderLayer(nn.Module):
  config: Config
  local: bool = False  # OLMo 3's sliding-window layers (`olmo3.attention`)

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    attended, per_layer = Attention(cfg, self.local, name="self_attention")(x, positions, segment_ids)
    x = x + norm(cfg, name="post_self_attention_layer_norm")(attended)
    out = MlpBlock(cfg, name="mlp")(x)
    return x + norm(cfg, name="post_mlp_layer_norm")(out), per_layer


class Olmo3Block(nn.Module):
  """OLMo 3's repeating unit: three sliding-window layers, then a global one (`olmo3.SUBLAYERS`).

  The decoder stacks and scans blocks, as MaxText's Olmo3ScannableBlock, so
  the alternating windows need no loop over layers.
  """

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    for name in olmo3.SUBLAYERS:
      x, _ = Olmo2DecoderLayer(self.config, name != olmo3.GLOBAL, name=name)(x, positions, segment_ids)
    return x, {}  # no per-layer values: QK-Clip, their one source here, is refused with the QK-norm
