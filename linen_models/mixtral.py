"""Mixtral decoder layer: Llama's attention and norms, the MLP replaced by routed experts (`MoeBlock_0`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention import Attention
from linen_models.moe import RoutedMoE
from linen_models.normalizations import RMSNorm
from maxbridge.config import Config


class MixtralDecoderLayer(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    cfg = self.config
    norm = dict(
        epsilon=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
    )
    h = RMSNorm(cfg.emb_dim, name="pre_self_attention_layer_norm", **norm)(x)
    x = x + Attention(cfg, name="self_attention")(h, positions, segment_ids)
    h = RMSNorm(cfg.emb_dim, name="post_self_attention_layer_norm", **norm)(x)
    out, aux = RoutedMoE(cfg, cfg.mlp_dim, name="MoeBlock_0")(h)
    return x + out, aux
