"""Multi-token prediction modules (DeepSeek-V3; MaxText's `multi_token_prediction.py`), run by the `Decoder`.

Module k: hidden_norm(h) and embedding_norm(embedding of token i + k),
concatenated (in MaxText's order), projected back to the model width, then one
decoder layer of the family. The decoder's final norm and output head, shared
with the main prediction, turn each module's hidden state into its logits.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.linears import dense
from linen_models.normalizations import norm
from maxbridge.core.config import Config
from maxbridge.ops import mtp


class MTPLayer(nn.Module):
  config: Config
  layer_class: type[nn.Module]

  @nn.compact
  def __call__(self, hidden: jax.Array, embedded: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    cfg = self.config
    both = jnp.concatenate([norm(cfg, name="hidden_norm")(hidden), norm(cfg, name="embedding_norm")(embedded)], -1)
    x = dense(cfg, (2 * cfg.emb_dim,), (cfg.emb_dim,), ("mlp", "embed"), name="projection")(both)
    # The layer's own per-layer values (an MoE layer's load-balancing loss) stay out of the loss, as in MaxText.
    x, _ = self.layer_class(cfg, name="layer")(x, positions, segment_ids)
    return x


class MTPBlock(nn.Module):
  """`mtp_num_layers` modules in sequence: the decoder's last hidden states [B, T, D] -> theirs [K, B, T, D]."""

  config: Config
  layer_class: type[nn.Module]

  @nn.compact
  def __call__(self, hidden: jax.Array, embedded: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    out = []
    for k in range(1, self.config.mtp_num_layers + 1):
      embedded_k, positions_k = mtp.module_inputs(embedded, positions, k)
      hidden = MTPLayer(self.config, self.layer_class, name=f"mtp_layer_{k}")(
          hidden, embedded_k, positions_k, segment_ids
      )
      out.append(hidden)
    return jnp.stack(out)
