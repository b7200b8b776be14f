"""The top-level Transformer: token embedder + a decoder stack (NNX or bridged Linen)."""

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core.config import Config
from nnx_models import Module
from nnx_models.embeddings import Embed


class Transformer(Module):
  """int32 tokens [B, T] -> float32 logits [B, T, V].

  `decoder_factory(rngs)` is given by `maxbridge.models.dispatch`: it builds an NNX
  `Decoder`, or a Linen one wrapped in `maxbridge.core.bridge.ToNNX`.
  """

  def __init__(
      self,
      config: Config,
      decoder_factory: Callable[[nnx.Rngs], nnx.Module],
      *,
      rngs: nnx.Rngs,
  ):
    cfg = self.config = config
    self.token_embedder = Embed(cfg.vocab_size, cfg.emb_dim, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype), rngs=rngs)
    self.decoder = decoder_factory(rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    x = self.token_embedder(tokens)
    table = self.token_embedder.embedding[...] if self.config.logits_via_embedding else None
    return self.decoder(x, positions, segment_ids, table, tokens)
