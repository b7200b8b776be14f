"""Llama decoder layer and the decoder stack (layers, final norm, output head)."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention import Attention
from linen_models.linears import DenseGeneral
from linen_models.mlp import MlpBlock
from linen_models.normalizations import RMSNorm
from maxbridge.config import Config
from maxbridge.ops import embedding as embedding_ops
from maxbridge.ops import remat


class DecoderLayer(nn.Module):
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
    x = x + MlpBlock(cfg, name="mlp")(h)
    return x, None  # (carry, output) so that nn.scan can drive it


class Decoder(nn.Module):
  config: Config

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array,
      embedding: jax.Array | None = None,
  ) -> jax.Array:
    """Embedded tokens [B, T, D] -> float32 logits [B, T, V]; `embedding` ties the head."""
    cfg = self.config
    layer = DecoderLayer
    if cfg.remat_policy != "none":
      # prevent_cse only matters outside scan, where XLA could otherwise merge
      # the recomputation back into the forward pass.
      layer = nn.remat(
          layer, policy=remat.checkpoint_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers
      )
    if cfg.scan_layers:
      stack = nn.scan(
          layer,
          variable_axes={"params": cfg.param_scan_axis},
          split_rngs={"params": True},
          in_axes=(nn.broadcast, nn.broadcast),
          length=cfg.num_decoder_layers,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = stack(cfg, name="layers")(x, positions, segment_ids)
    else:
      for i in range(cfg.num_decoder_layers):
        x, _ = layer(cfg, name=f"layers_{i}")(x, positions, segment_ids)
    x = RMSNorm(
        cfg.emb_dim, cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype),
        jnp.dtype(cfg.weight_dtype), name="decoder_norm",
    )(x)
    self.sow("intermediates", "hidden_states", x)
    if cfg.logits_via_embedding:
      return embedding_ops.attend(x, embedding, dtype=jnp.dtype(cfg.dtype))
    logits = DenseGeneral(
        (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"),
        dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), name="logits_dense",
    )(x)
    return logits.astype(jnp.float32)
