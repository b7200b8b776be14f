"""GPT-2/GPT-3 decoder layer: LayerNorm with bias, fused qkv with biases, GELU MLP with biases.

Names follow MaxText's gpt3 block (`pre_self_attention_norm`, `self_attention/qkv_proj`,
`mlp/mlp_layer_norm`, `mlp/wi`, `mlp/wo`). One difference: a LayerNorm `scale`
here is the multiplier itself (Hugging Face's and Flax's convention), where
MaxText's Gpt3LayerNorm stores scale - 1. Learned positions and the tied head
live in the decoder (`position_embedder`, `logits_via_embedding`).
"""

import jax
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.ops import attention, mlp
from nnx_models import Module
from nnx_models.attention import attend
from nnx_models.linears import dense
from nnx_models.normalizations import norm


class Gpt3Attention(Module):
  """Multi-head attention (no grouped kv), one fused qkv projection; 1/sqrt(head_dim) at run time."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    heads, head_dim = cfg.num_query_heads, cfg.head_dim
    self.qkv_proj = dense(
        cfg, (cfg.emb_dim,), (3, heads, head_dim), ("embed", "qkv", "heads", "kv"), use_bias=True, rngs=rngs
    )
    self.out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), use_bias=True, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(output, per-layer values: the per-head max logits when QK-Clip is on)."""
    cfg = self.config
    qkv = self.qkv_proj(x)
    query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, per_layer = attend(self, cfg, cfg.family.attention(cfg), query, key, value, positions, segment_ids)
    return attention.with_out_projection(cfg, self.out(out), per_layer)


class Gpt3Mlp(Module):
  """LayerNorm, then wo(gelu(wi x)), biases on both."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    self.mlp_layer_norm = norm(cfg, rngs=rngs)
    self.wi = dense(cfg, (cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), use_bias=True, rngs=rngs)
    self.wo = dense(cfg, (cfg.mlp_dim,), (cfg.emb_dim,), ("mlp", "embed"), use_bias=True, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.wo(mlp.gelu_tanh(self.wi(self.mlp_layer_norm(x))))


class Gpt3DecoderLayer(Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.pre_self_attention_norm = norm(config, rngs=rngs)
    self.self_attention = Gpt3Attention(config, rngs=rngs)
    self.mlp = Gpt3Mlp(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    attended, per_layer = self.self_attention(self.pre_self_attention_norm(x), positions, segment_ids)
    x = x + attended
    x = x + self.mlp(x)
    return x, per_layer
