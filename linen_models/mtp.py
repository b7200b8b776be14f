"""Multi-token prediction modules (DeepSeek-V3; MaxText's `multi_token_prediction.py`), run by the `Decoder`.

Module k: hidden_norm(h) and embedding_norm(embedding of token i + k),
concatenated (in MaxText's order), projected back to the model width, then one
decoder layer of the family. Its own final norm (`head_norm`, DeepSeek-V3's
`shared_head.norm`), then the output head shared with the main prediction,
turn its hidden state into its logits; the next module reads the un-normed one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.linears import dense
from linen_models.normalizations import norm
from maxbridge.core.config import Config
from maxbridge.ops import mtp, output_head


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
    return x, norm(cfg, name="head_norm")(x)


class MTPBlock(nn.Module):
  """`mtp_num_layers` modules in sequence: the decoder's last hidden states [B, T, D] -> theirs [K, B, T, D],
  each normed by its module's `head_norm`: what the shared projection reads."""

  config: Config
  layer_class: type[nn.Module]

  @nn.compact
  def __call__(self, hidden: jax.Array, embedded: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    out = []
    for k in range(1, self.config.mtp_num_layers + 1):
      embedded_k, positions_k = mtp.module_inputs(embedded, positions, k)
      hidden, normed = MTPLayer(self.config, self.layer_class, name=f"mtp_layer_{k}")(
          hidden, embedded_k, positions_k, segment_ids
      )
      out.append(normed)
    return jnp.stack(out)


class MTPDrafter(nn.Module):
  """Module k alone (its own final norm included), then the output head: self-speculative decoding's draft step.

  Its parameters are the decoder's own (`mtp/mtp_layer_{k}`, `logits_dense`); given a "cache" collection,
  module k's attention appends to and reads a cache of its own (`maxbridge.serving.speculative`).
  Returns (logits [B, T, V], module k's hidden states [B, T, D]).
  """

  config: Config
  layer_class: type[nn.Module]
  k: int

  @nn.compact
  def __call__(self, hidden, embedded, positions, segment_ids, embedding=None):
    cfg = self.config
    hidden, normed = MTPLayer(cfg, self.layer_class, name=f"mtp_layer_{self.k}")(hidden, embedded, positions, segment_ids)
    project = None
    if not cfg.logits_via_embedding:
      project = dense(cfg, (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), name="logits_dense")
    logits = output_head.output_logits(
        normed,
        norm=lambda h: h,  # normed by the module's head_norm
        project=project,
        embedding=embedding,
        dtype=jnp.dtype(cfg.dtype),
        normalize_embedding_logits=cfg.normalize_embedding_logits,
        final_logits_soft_cap=cfg.final_logits_soft_cap,
    )
    return logits, hidden
