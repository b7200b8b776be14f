"""Llama decoder layer and the decoder stack (layers, final norm, output head).

`config.decoder_block` picks the layer class of each stack (`layer_classes`);
the stacks themselves, their names and sizes, come from `canonical.layer_stacks`.
A layer returns (x, aux): aux is its MoE load-balancing loss, or None.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge import canonical
from maxbridge.config import Config
from maxbridge.ops import embedding as embedding_ops
from maxbridge.ops import output_head
from maxbridge.ops import linear
from maxbridge.ops import moe as moe_ops
from maxbridge.ops import remat
from nnx_models.attention import Attention
from nnx_models.deepseek import DeepSeekDenseLayer, DeepSeekMoELayer
from nnx_models.embeddings import Embed
from nnx_models.gpt3 import Gpt3DecoderLayer, LayerNorm
from nnx_models.linears import DenseGeneral
from nnx_models.mixtral import MixtralDecoderLayer
from nnx_models.mlp import MlpBlock
from nnx_models.normalizations import RMSNorm


class DecoderLayer(nnx.Module):

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
    self.mlp = MlpBlock(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    h = self.pre_self_attention_layer_norm(x)
    x = x + self.self_attention(h, positions, segment_ids)
    h = self.post_self_attention_layer_norm(x)
    x = x + self.mlp(h)
    return x, None  # (carry, output), as the Linen layer returns for nn.scan


def layer_classes(config: Config) -> dict[str, type[nnx.Module]]:
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
  raise NotImplementedError(f"decoder_block {block!r} has no NNX decoder layer")


class Decoder(nnx.Module):

  def __init__(self, config: Config, dot_general: linear.DotGeneral = jax.lax.dot_general, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.dot_general = dot_general  # the tied head's matmul
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    if cfg.decoder_block == "gpt3":  # learned absolute positions
      self.position_embedder = Embed(cfg.trainable_position_size, cfg.emb_dim, **dtypes)
    classes = layer_classes(cfg)
    for name, count in canonical.layer_stacks(cfg):
      if cfg.scan_layers:
        setattr(self, name, _stacked_layers(classes[name], cfg, count, rngs))
      else:
        for i in range(count):
          setattr(self, f"{name}_{i}", classes[name](cfg, rngs=rngs))
    norm = LayerNorm if cfg.decoder_block == "gpt3" else RMSNorm
    self.decoder_norm = norm(cfg.emb_dim, cfg.normalization_layer_epsilon, **dtypes)
    if not cfg.logits_via_embedding:
      self.logits_dense = DenseGeneral((cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), **dtypes)

  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array,
      embedding: jax.Array | None = None,
  ) -> jax.Array:
    """Embedded tokens [B, T, D] -> float32 logits [B, T, V]; `embedding` ties the head."""
    cfg = self.config
    if cfg.decoder_block == "gpt3":
      x = x + self.position_embedder(positions)
    aux_losses = []
    for name, count in canonical.layer_stacks(cfg):
      if cfg.scan_layers:
        graphdef, state = nnx.split(getattr(self, name))
        step = _layer_step(graphdef, cfg, positions, segment_ids)
        # lax.scan walks the leading axis; the stack lives on param_scan_axis.
        state = jax.tree.map(lambda a: jnp.moveaxis(a, cfg.param_scan_axis, 0), state)
        x, aux = jax.lax.scan(lambda carry, layer: step(layer, carry), x, state)
        aux_losses.append(aux)
      else:
        for i in range(count):
          graphdef, state = nnx.split(getattr(self, f"{name}_{i}"))
          x, aux = _layer_step(graphdef, cfg, positions, segment_ids)(state, x)
          aux_losses.append(aux)
    aux_losses = [aux for aux in aux_losses if aux is not None]
    if aux_losses:
      self.sow(nnx.Intermediate, "moe_lb_loss", moe_ops.mean_layer_losses(aux_losses))
    # Before the final norm, which belongs to the output head: vocabulary
    # tiling runs that head itself, tile by tile.
    self.sow(nnx.Intermediate, "hidden_states", x)
    if cfg.logits_via_embedding:
      project = functools.partial(
          embedding_ops.attend, embedding=embedding, dtype=jnp.dtype(cfg.dtype), dot_general=self.dot_general
      )
    else:
      project = self.logits_dense
    return output_head.output_logits(x, norm=self.decoder_norm, project=project)


def _stacked_layers(layer_class, cfg: Config, count: int, rngs: nnx.Rngs) -> nnx.Module:
  """`count` layers, one per split key, stacked on param_scan_axis.

  The "layers" logical axis is inserted there, as Linen's nn.scan does.
  """

  @nnx.split_rngs(splits=count)
  @nnx.vmap(
      in_axes=0,
      out_axes=cfg.param_scan_axis,
      transform_metadata={nnx.PARTITION_NAME: "layers"},
  )
  def make_layers(rngs: nnx.Rngs) -> nnx.Module:
    return layer_class(cfg, rngs=rngs)

  return make_layers(rngs)


def _layer_step(graphdef, cfg: Config, positions: jax.Array, segment_ids: jax.Array):
  """(layer state, x) -> (x, aux) as a pure function, so jax.checkpoint and lax.scan see plain arrays."""

  def step(state, x):
    return nnx.merge(graphdef, state)(x, positions, segment_ids)

  if cfg.remat_policy == "none":
    return step
  # prevent_cse only matters outside scan, where XLA could otherwise merge the
  # recomputation back into the forward pass (the same choice nn.remat gets).
  return jax.checkpoint(step, policy=remat.checkpoint_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
