"""Llama decoder layer and the decoder stack (layers, final norm, output head).

`config.decoder_block` picks the layer class of each stack (`layer_classes`);
the stacks themselves, their names and sizes, come from `canonical.layer_stacks`.
A layer returns (x, aux): aux is its MoE load-balancing loss, or None.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention import Attention
from linen_models.deepseek import DeepSeekDenseLayer, DeepSeekMoELayer
from linen_models.embeddings import Embed
from linen_models.gpt3 import Gpt3DecoderLayer, LayerNorm
from linen_models.linears import DenseGeneral
from linen_models.mixtral import MixtralDecoderLayer
from linen_models.mlp import MlpBlock
from linen_models.normalizations import RMSNorm
from maxbridge import canonical
from maxbridge.config import Config
from maxbridge.ops import embedding as embedding_ops
from maxbridge.ops import output_head
from maxbridge.ops import linear
from maxbridge.ops import moe as moe_ops
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


def layer_classes(config: Config) -> dict[str, type[nn.Module]]:
  """Stack name -> layer class for `config.decoder_block` (llama2, mistral and qwen3 share one).

  DeepSeek has two stacks, `dense_layers` then `moe_layers` (`canonical.layer_stacks`).
  """
  block = config.decoder_block
  if block in ("llama2", "mistral", "qwen3"):
    return {"layers": DecoderLayer}
  if block == "gpt3":
    return {"layers": Gpt3DecoderLayer}
  if block == "mixtral":
    return {"layers": MixtralDecoderLayer}
  if block == "deepseek":
    return {"dense_layers": DeepSeekDenseLayer, "moe_layers": DeepSeekMoELayer}
  raise NotImplementedError(f"decoder_block {block!r} has no Linen decoder layer")


class Decoder(nn.Module):
  config: Config
  dot_general: linear.DotGeneral = jax.lax.dot_general  # the tied head's matmul

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
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    if cfg.decoder_block == "gpt3":  # learned absolute positions
      x = x + Embed(cfg.trainable_position_size, cfg.emb_dim, name="position_embedder", **dtypes)(positions)
    classes = layer_classes(cfg)
    aux_losses = []
    for name, count in canonical.layer_stacks(cfg):
      layer = classes[name]
      if cfg.remat_policy != "none":
        # prevent_cse only matters outside scan, where XLA could otherwise merge
        # the recomputation back into the forward pass.
        layer = nn.remat(layer, policy=remat.checkpoint_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
      if cfg.scan_layers:
        stack = nn.scan(
            layer,
            variable_axes={"params": cfg.param_scan_axis},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=count,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, aux = stack(cfg, name=name)(x, positions, segment_ids)
        aux_losses.append(aux)
      else:
        for i in range(count):
          x, aux = layer(cfg, name=f"{name}_{i}")(x, positions, segment_ids)
          aux_losses.append(aux)
    aux_losses = [aux for aux in aux_losses if aux is not None]
    if aux_losses:
      self.sow("intermediates", "moe_lb_loss", moe_ops.mean_layer_losses(aux_losses))
    norm = LayerNorm if cfg.decoder_block == "gpt3" else RMSNorm
    # Before the final norm, which belongs to the output head: vocabulary
    # tiling runs that head itself, tile by tile.
    self.sow("intermediates", "hidden_states", x)
    if cfg.logits_via_embedding:
      project = functools.partial(
          embedding_ops.attend, embedding=embedding, dtype=jnp.dtype(cfg.dtype), dot_general=self.dot_general
      )
    else:
      project = DenseGeneral(
          (cfg.emb_dim,),
          (cfg.vocab_size,),
          ("embed", "vocab"),
          dtype=jnp.dtype(cfg.dtype),
          weight_dtype=jnp.dtype(cfg.weight_dtype),
          name="logits_dense",
      )
    decoder_norm = norm(cfg.emb_dim, cfg.normalization_layer_epsilon, name="decoder_norm", **dtypes)
    return output_head.output_logits(x, norm=decoder_norm, project=project)
