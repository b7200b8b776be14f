"""Gemma 3's vision tower: the SigLIP encoder and the projector to the text width (math in `ops.vision`)."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.ops import vision
from nnx_models import Module
from nnx_models.embeddings import Embed
from nnx_models.linears import DenseGeneral
from nnx_models.normalizations import LayerNorm, RMSNorm


def _dense(config: Config, in_features, out_features, logical_axes, *, rngs: nnx.Rngs) -> DenseGeneral:
  # The tower's matmuls stay float: quantization (AQT, Qwix) is the decoder's.
  dtypes = dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype))
  return DenseGeneral(tuple(in_features), tuple(out_features), logical_axes, use_bias=True, rngs=rngs, **dtypes)


def _layer_norm(config: Config, *, rngs: nnx.Rngs) -> LayerNorm:
  eps = config.normalization_layer_epsilon_for_vit
  return LayerNorm(config.hidden_size_for_vit, eps, jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype), rngs=rngs)


class EncoderAttention(Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    width, heads = config.hidden_size_for_vit, config.num_attention_heads_for_vit
    shape = (heads, width // heads)
    self.query = _dense(config, (width,), shape, ("embed", "heads", "kv"), rngs=rngs)
    self.key = _dense(config, (width,), shape, ("embed", "heads", "kv"), rngs=rngs)
    self.value = _dense(config, (width,), shape, ("embed", "heads", "kv"), rngs=rngs)
    self.out = _dense(config, shape, (width,), ("heads", "kv", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(vision.encoder_attention(self.query(x), self.key(x), self.value(x)))


class EncoderMlp(Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    width, hidden = config.hidden_size_for_vit, config.intermediate_size_for_vit
    self.wi = _dense(config, (width,), (hidden,), ("embed", "mlp"), rngs=rngs)
    self.wo = _dense(config, (hidden,), (width,), ("mlp", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.wo(vision.gelu_tanh(self.wi(x)))


class EncoderBlock(Module):
  """x + attention(LayerNorm(x)), then x + mlp(LayerNorm(x))."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.pre_attention_norm = _layer_norm(config, rngs=rngs)
    self.attention = EncoderAttention(config, rngs=rngs)
    self.pre_mlp_norm = _layer_norm(config, rngs=rngs)
    self.mlp = EncoderMlp(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.pre_attention_norm(x))
    return x + self.mlp(self.pre_mlp_norm(x))


class VisionEncoder(Module):
  """SigLIP: images [B, H, W, C] -> patch embeddings [B, (H/p) * (W/p), hidden_size_for_vit]."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    p, channels, width = config.patch_size_for_vit, config.num_channels_for_vit, config.hidden_size_for_vit
    self.embedding = _dense(config, (p, p, channels), (width,), (None, None, None, "embed"), rngs=rngs)
    self.count = (config.image_size_for_vit // p) ** 2
    dtypes = dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype))
    self.position_embedding = Embed(self.count, width, rngs=rngs, **dtypes)
    for i in range(config.num_hidden_layers_for_vit):
      setattr(self, f"encoderblock_{i}", EncoderBlock(config, rngs=rngs))
    self.encoder_norm = _layer_norm(config, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    x = self.embedding(vision.patches(images, self.config.patch_size_for_vit))
    x = x + self.position_embedding(jnp.arange(self.count))
    for i in range(self.config.num_hidden_layers_for_vit):
      x = getattr(self, f"encoderblock_{i}")(x)
    return self.encoder_norm(x)


class VisionProjector(Module):
  """Patch embeddings -> vision_output_length soft tokens [B, tokens, emb_dim]: pool, Gemma's RMSNorm, project."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    dtypes = dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype))
    self.mm_soft_embedding_norm = RMSNorm(
        config.hidden_size_for_vit, config.normalization_layer_epsilon_for_vit, rngs=rngs, **dtypes
    )
    self.mm_input_projection = DenseGeneral(
        (config.hidden_size_for_vit,), (config.emb_dim,), ("mlp", "embed"), rngs=rngs, **dtypes
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    x = vision.average_pool(x, self.config.vision_output_length)
    return self.mm_input_projection(self.mm_soft_embedding_norm(x))
