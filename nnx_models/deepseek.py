"""DeepSeek-V3 decoder layers: MLA attention, then a dense MLP (the first
`first_num_dense_layers`) or routed + shared experts (`DeepSeekMoeBlock_0`)."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.config import Config
from nnx_models.attention_mla import MLA
from nnx_models.mlp import MlpBlock
from nnx_models.moe import RoutedAndSharedMoE
from nnx_models.normalizations import RMSNorm


class _AttentionBlock(nnx.Module):
  """The half both layers share: x + attention(norm(x)), and the post-attention norm of that."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    norm = dict(
        epsilon=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        rngs=rngs,
    )
    self.pre_self_attention_layer_norm = RMSNorm(cfg.emb_dim, **norm)
    self.self_attention = MLA(cfg, rngs=rngs)
    self.post_self_attention_layer_norm = RMSNorm(cfg.emb_dim, **norm)

  def attend(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    x = x + self.self_attention(self.pre_self_attention_layer_norm(x), positions, segment_ids)
    return x, self.post_self_attention_layer_norm(x)


class DeepSeekDenseLayer(_AttentionBlock):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    super().__init__(config, rngs=rngs)
    self.mlp = MlpBlock(config, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    x, h = self.attend(x, positions, segment_ids)
    return x + self.mlp(h), None


class DeepSeekMoELayer(_AttentionBlock):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    super().__init__(config, rngs=rngs)
    self.DeepSeekMoeBlock_0 = RoutedAndSharedMoE(config, rngs=rngs)  # pylint: disable=invalid-name

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    x, h = self.attend(x, positions, segment_ids)
    out, aux = self.DeepSeekMoeBlock_0(h)
    return x + out, aux
