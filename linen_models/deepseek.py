"""DeepSeek-V3 decoder layers: MLA attention, then a dense MLP (the first
`first_num_dense_layers`) or routed + shared experts (`DeepSeekMoeBlock_0`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention_mla import MLA
from linen_models.mlp import MlpBlock
from linen_models.moe import RoutedAndSharedMoE
from linen_models.normalizations import RMSNorm
from maxbridge.config import Config


class DeepSeekDenseLayer(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    cfg = self.config
    x, h = _attention_block(cfg, x, positions, segment_ids)
    return x + MlpBlock(cfg, name="mlp")(h), None


class DeepSeekMoELayer(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    cfg = self.config
    x, h = _attention_block(cfg, x, positions, segment_ids)
    out, aux = RoutedAndSharedMoE(cfg, name="DeepSeekMoeBlock_0")(h)
    return x + out, aux


def _attention_block(cfg: Config, x, positions, segment_ids):
  """(x + attention(norm(x)), post-attention norm of that): the half both layers share.

  Called from a compact __call__, so the modules it makes belong to that layer.
  """
  norm = dict(
      epsilon=cfg.normalization_layer_epsilon,
      dtype=jnp.dtype(cfg.dtype),
      weight_dtype=jnp.dtype(cfg.weight_dtype),
  )
  h = RMSNorm(cfg.emb_dim, name="pre_self_attention_layer_norm", **norm)(x)
  x = x + MLA(cfg, name="self_attention")(h, positions, segment_ids)
  return x, RMSNorm(cfg.emb_dim, name="post_self_attention_layer_norm", **norm)(x)
