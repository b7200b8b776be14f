"""Multi-token prediction modules (DeepSeek-V3; MaxText's `multi_token_prediction.py`), run by the `Decoder`.

Module k: hidden_norm(h) and embedding_norm(embedding of token i + k),
concatenated (in MaxText's order), projected back to the model width, then one
decoder layer of the family. Its own final norm (`head_norm`, DeepSeek-V3's
`shared_head.norm`), then the output head shared with the main prediction,
turn its hidden state into its logits; the next module reads the un-normed one.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.ops import mtp, output_head
from nnx_models import Module
from nnx_models.linears import dense
from nnx_models.normalizations import norm


class MTPLayer(Module):

  def __init__(self, config: Config, layer_class: type[nnx.Module], *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.hidden_norm = norm(cfg, rngs=rngs)
    self.embedding_norm = norm(cfg, rngs=rngs)
    self.projection = dense(cfg, (2 * cfg.emb_dim,), (cfg.emb_dim,), ("mlp", "embed"), rngs=rngs)
    self.layer = layer_class(cfg, rngs=rngs)
    self.head_norm = norm(cfg, rngs=rngs)

  def __call__(self, hidden: jax.Array, embedded: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    both = jnp.concatenate([self.hidden_norm(hidden), self.embedding_norm(embedded)], -1)
    # The layer's own per-layer values (an MoE layer's load-balancing loss) stay out of the loss, as in MaxText.
    x, _ = self.layer(self.projection(both), positions, segment_ids)
    return x, self.head_norm(x)


class MTPBlock(Module):
  """`mtp_num_layers` modules in sequence: the decoder's last hidden states [B, T, D] -> theirs [K, B, T, D],
  each normed by its module's `head_norm`: what the shared projection reads."""

  def __init__(self, config: Config, layer_class: type[nnx.Module], *, rngs: nnx.Rngs):
    self.config = config
    for k in range(1, config.mtp_num_layers + 1):
      setattr(self, f"mtp_layer_{k}", MTPLayer(config, layer_class, rngs=rngs))

  def __call__(self, hidden: jax.Array, embedded: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    out = []
    for k in range(1, self.config.mtp_num_layers + 1):
      embedded_k, positions_k = mtp.module_inputs(embedded, positions, k)
      hidden, normed = getattr(self, f"mtp_layer_{k}")(hidden, embedded_k, positions_k, segment_ids)
      out.append(normed)
    return jnp.stack(out)


class MTPDrafter(Module):
  """Module k alone (its own final norm included), then the output head: self-speculative decoding's draft step.

  Its parameters are the decoder's own (`mtp/mtp_layer_{k}`, `logits_dense`); given `nnx.Cache` variables,
  module k's attention appends to and reads a cache of its own (`maxbridge.serving.speculative`).
  Returns (logits [B, T, V], module k's hidden states [B, T, D]).
  """

  def __init__(self, config: Config, layer_class: type[nnx.Module], k: int, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.k = k
    setattr(self, f"mtp_layer_{k}", MTPLayer(cfg, layer_class, rngs=rngs))
    if not cfg.logits_via_embedding:
      self.logits_dense = dense(cfg, (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), rngs=rngs)

  def __call__(self, hidden, embedded, positions, segment_ids, embedding=None):
    cfg = self.config
    hidden, normed = getattr(self, f"mtp_layer_{self.k}")(hidden, embedded, positions, segment_ids)
    logits = output_head.output_logits(
        normed,
        norm=lambda h: h,  # normed by the module's head_norm
        project=None if cfg.logits_via_embedding else self.logits_dense,
        embedding=embedding,
        dtype=jnp.dtype(cfg.dtype),
        normalize_embedding_logits=cfg.normalize_embedding_logits,
        final_logits_soft_cap=cfg.final_logits_soft_cap,
    )
    return logits, hidden
