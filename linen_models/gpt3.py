"""GPT-2/GPT-3 decoder layer: LayerNorm with bias, fused qkv with biases, GELU MLP with biases.

Names follow MaxText's gpt3 block (`pre_self_attention_norm`, `self_attention/qkv_proj`,
`mlp/mlp_layer_norm`, `mlp/wi`, `mlp/wo`). One difference: a LayerNorm `scale`
here is the multiplier itself (Hugging Face's and Flax's convention), where
MaxText's Gpt3LayerNorm stores scale - 1. Learned positions and the tied head
live in the decoder (`position_embedder`, `logits_via_embedding`).
"""

import flax.linen as nn
import jax

from linen_models.attention import attend
from linen_models.linears import dense
from linen_models.normalizations import norm
from maxbridge.core.config import Config
from maxbridge.ops import attention, mlp


class Gpt3Attention(nn.Module):
  """Multi-head attention (no grouped kv), one fused qkv projection; 1/sqrt(head_dim) at run time."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(output, per-layer values: the per-head max logits when QK-Clip is on)."""
    cfg = self.config
    heads, head_dim = cfg.num_query_heads, cfg.head_dim
    qkv = dense(
        cfg, (cfg.emb_dim,), (3, heads, head_dim), ("embed", "qkv", "heads", "kv"), name="qkv_proj", use_bias=True
    )(x)
    query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, per_layer = attend(self, cfg, cfg.family.attention(cfg), query, key, value, positions, segment_ids)
    out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out", use_bias=True)(out)
    return attention.with_out_projection(cfg, out, per_layer)


class Gpt3Mlp(nn.Module):
  """LayerNorm, then wo(gelu(wi x)), biases on both."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    h = norm(cfg, name="mlp_layer_norm")(x)
    h = dense(cfg, (cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), name="wi", use_bias=True)(h)
    h = mlp.gelu_tanh(h)
    return dense(cfg, (cfg.mlp_dim,), (cfg.emb_dim,), ("mlp", "embed"), name="wo", use_bias=True)(h)


class Gpt3DecoderLayer(nn.Module):
  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_norm")(x)
    attended, per_layer = Gpt3Attention(cfg, name="self_attention")(h, positions, segment_ids)
    x = x + attended
    x = x + Gpt3Mlp(cfg, name="mlp")(x)
    return x, per_layer
