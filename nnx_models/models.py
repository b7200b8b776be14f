"""The top-level Transformer: token embedder + a decoder stack (NNX or bridged Linen)."""

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.ops import vision
from nnx_models import Module
from nnx_models.embeddings import Embed
from nnx_models.vision import VisionEncoder, VisionProjector


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
    if cfg.use_multimodal:
      self.vision_encoder = VisionEncoder(cfg, rngs=rngs)
      self.vision_projector = VisionProjector(cfg, rngs=rngs)
    self.decoder = decoder_factory(rngs)

  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array,
      multimodal_input: vision.MultimodalInput | None = None,
  ) -> jax.Array:
    """`multimodal_input` (use_multimodal=true): images whose soft tokens take the places of the image tokens."""
    cfg = self.config
    x = self.token_embedder(tokens)
    if multimodal_input is not None:
      if not cfg.use_multimodal:
        raise ValueError("multimodal_input given to a model without a vision tower: set use_multimodal=true")
      embedded = vision.image_embeddings(self.vision_encoder, self.vision_projector, multimodal_input.images)
      x, segment_ids = vision.join_images(x, tokens, segment_ids, embedded, cfg.image_token_index)
    table = self.token_embedder.embedding[...] if self.config.logits_via_embedding else None
    return self.decoder(x, positions, segment_ids, table, tokens)
