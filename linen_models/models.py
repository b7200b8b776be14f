"""The top-level Transformer: token embedder + a decoder stack (Linen or bridged NNX)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.embeddings import Embed
from linen_models.vision import VisionEncoder, VisionProjector
from maxbridge.core.config import Config
from maxbridge.ops import vision


class Transformer(nn.Module):
  """int32 tokens [B, T] -> float32 logits [B, T, V].

  `decoder` is given by `maxbridge.models.dispatch`: a Linen `Decoder`, or an NNX one
  wrapped in `maxbridge.core.bridge.ToLinen`. Either is adopted as child "decoder".
  """

  config: Config
  decoder: nn.Module

  @nn.compact
  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array,
      multimodal_input: vision.MultimodalInput | None = None,
  ) -> jax.Array:
    """`multimodal_input` (use_multimodal=true): images whose soft tokens take the places of the image tokens."""
    cfg = self.config
    embedder = Embed(
        cfg.vocab_size,
        cfg.emb_dim,
        jnp.dtype(cfg.dtype),
        jnp.dtype(cfg.weight_dtype),
        name="token_embedder",
    )
    x = embedder(tokens)
    if cfg.use_multimodal:
      encoder, projector = VisionEncoder(cfg, name="vision_encoder"), VisionProjector(cfg, name="vision_projector")
      if multimodal_input is not None:
        embedded = vision.image_embeddings(encoder, projector, multimodal_input.images)
        x, segment_ids = vision.join_images(x, tokens, segment_ids, embedded, cfg.image_token_index)
      elif self.is_initializing():  # declares the tower's parameters, which a text-only call never reaches
        size, channels = cfg.image_size_for_vit, cfg.num_channels_for_vit
        projector(encoder(jnp.zeros((1, size, size, channels), jnp.dtype(cfg.dtype))))
    elif multimodal_input is not None:
      raise ValueError("multimodal_input given to a model without a vision tower: set use_multimodal=true")
    table = embedder.embedding if cfg.logits_via_embedding else None
    return self.decoder(x, positions, segment_ids, table, tokens)
