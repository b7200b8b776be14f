"""The top-level Transformer: token embedder + a decoder stack (Linen or bridged NNX)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.embeddings import Embed
from maxbridge.core.config import Config


class Transformer(nn.Module):
  """int32 tokens [B, T] -> float32 logits [B, T, V].

  `decoder` is given by `maxbridge.models.dispatch`: a Linen `Decoder`, or an NNX one
  wrapped in `maxbridge.core.bridge.ToLinen`. Either is adopted as child "decoder".
  """

  config: Config
  decoder: nn.Module

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    cfg = self.config
    embedder = Embed(
        cfg.vocab_size,
        cfg.emb_dim,
        jnp.dtype(cfg.dtype),
        jnp.dtype(cfg.weight_dtype),
        name="token_embedder",
    )
    x = embedder(tokens)
    table = embedder.embedding if cfg.logits_via_embedding else None
    return self.decoder(x, positions, segment_ids, table, tokens)
