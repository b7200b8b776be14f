"""Mixtral decoder layer: Llama's attention and norms, the MLP replaced by routed experts (`MoeBlock_0`)."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.config import Config
from nnx_models.attention import Attention
from nnx_models.moe import RoutedMoE
from nnx_models.normalizations import RMSNorm


class MixtralDecoderLayer(nnx.Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    norm = dict(
        epsilon=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        rngs=rngs,
    )
    self.pre_self_attention_layer_norm = RMSNorm(cfg.emb_dim, **norm)
    self.self_attention = Attention(cfg, rngs=rngs)
    self.post_self_attention_layer_norm = RMSNorm(cfg.emb_dim, **norm)
    self.MoeBlock_0 = RoutedMoE(cfg, cfg.mlp_dim, rngs=rngs)  # pylint: disable=invalid-name

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    h = self.pre_self_attention_layer_norm(x)
    x = x + self.self_attention(h, positions, segment_ids)
    h = self.post_self_attention_layer_norm(x)
    out, aux = self.MoeBlock_0(h)
    return x + out, aux
