"""Gemma 3's vision tower: the SigLIP encoder and the projector to the text width (math in `ops.vision`)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.embeddings import Embed
from linen_models.linears import DenseGeneral
from linen_models.normalizations import LayerNorm, RMSNorm
from maxbridge.core.config import Config
from maxbridge.ops import vision


def _dense(config: Config, in_features, out_features, logical_axes, *, name: str) -> DenseGeneral:
  # The tower's matmuls stay float: quantization (AQT, Qwix) is the decoder's.
  dtypes = dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype))
  return DenseGeneral(tuple(in_features), tuple(out_features), logical_axes, use_bias=True, name=name, **dtypes)


def _layer_norm(config: Config, *, name: str) -> LayerNorm:
  eps = config.normalization_layer_epsilon_for_vit
  return LayerNorm(config.hidden_size_for_vit, eps, jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype), name=name)


class EncoderAttention(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    width, heads = cfg.hidden_size_for_vit, cfg.num_attention_heads_for_vit
    shape = (heads, width // heads)
    q, k, v = (_dense(cfg, (width,), shape, ("embed", "heads", "kv"), name=n)(x) for n in ("query", "key", "value"))
    return _dense(cfg, shape, (width,), ("heads", "kv", "embed"), name="out")(vision.encoder_attention(q, k, v))


class EncoderMlp(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    width, hidden = cfg.hidden_size_for_vit, cfg.intermediate_size_for_vit
    h = vision.gelu_tanh(_dense(cfg, (width,), (hidden,), ("embed", "mlp"), name="wi")(x))
    return _dense(cfg, (hidden,), (width,), ("mlp", "embed"), name="wo")(h)


class EncoderBlock(nn.Module):
  """x + attention(LayerNorm(x)), then x + mlp(LayerNorm(x))."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = x + EncoderAttention(cfg, name="attention")(_layer_norm(cfg, name="pre_attention_norm")(x))
    return x + EncoderMlp(cfg, name="mlp")(_layer_norm(cfg, name="pre_mlp_norm")(x))


class VisionEncoder(nn.Module):
  """SigLIP: images [B, H, W, C] -> patch embeddings [B, (H/p) * (W/p), hidden_size_for_vit]."""

  config: Config

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    cfg = self.config
    p, channels, width = cfg.patch_size_for_vit, cfg.num_channels_for_vit, cfg.hidden_size_for_vit
    x = _dense(cfg, (p, p, channels), (width,), (None, None, None, "embed"), name="embedding")(vision.patches(images, p))
    count = (cfg.image_size_for_vit // p) ** 2
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    x = x + Embed(count, width, name="position_embedding", **dtypes)(jnp.arange(count))
    for i in range(cfg.num_hidden_layers_for_vit):
      x = EncoderBlock(cfg, name=f"encoderblock_{i}")(x)
    return _layer_norm(cfg, name="encoder_norm")(x)


class VisionProjector(nn.Module):
  """Patch embeddings -> vision_output_length soft tokens [B, tokens, emb_dim]: pool, Gemma's RMSNorm, project."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = vision.average_pool(x, cfg.vision_output_length)
    x = RMSNorm(
        cfg.hidden_size_for_vit,
        cfg.normalization_layer_epsilon_for_vit,
        jnp.dtype(cfg.dtype),
        jnp.dtype(cfg.weight_dtype),
        name="mm_soft_embedding_norm",
    )(x)
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    projection = DenseGeneral(
        (cfg.hidden_size_for_vit,), (cfg.emb_dim,), ("mlp", "embed"), **dtypes, name="mm_input_projection"
    )
    return projection(x)
