"""Llama decoder layer and the decoder stack (layers, final norm, output head)."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.config import Config
from maxbridge.ops import embedding as embedding_ops
from maxbridge.ops import remat
from nnx_models.attention import Attention
from nnx_models.linears import DenseGeneral
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


class Decoder(nnx.Module):

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    if cfg.scan_layers:
      # One layer per split key, stacked on param_scan_axis; the "layers"
      # logical axis is inserted there, as Linen's nn.scan does.
      @nnx.split_rngs(splits=cfg.num_decoder_layers)
      @nnx.vmap(
          in_axes=0,
          out_axes=cfg.param_scan_axis,
          transform_metadata={nnx.PARTITION_NAME: "layers"},
      )
      def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, rngs=rngs)

      self.layers = make_layers(rngs)
    else:
      for i in range(cfg.num_decoder_layers):
        setattr(self, f"layers_{i}", DecoderLayer(cfg, rngs=rngs))
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    self.decoder_norm = RMSNorm(cfg.emb_dim, cfg.normalization_layer_epsilon, **dtypes)
    if not cfg.logits_via_embedding:
      self.logits_dense = DenseGeneral(
          (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), **dtypes
      )

  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array,
      embedding: jax.Array | None = None,
  ) -> jax.Array:
    """Embedded tokens [B, T, D] -> float32 logits [B, T, V]; `embedding` ties the head."""
    cfg = self.config
    if cfg.scan_layers:
      graphdef, state = nnx.split(self.layers)
      step = _layer_step(graphdef, cfg, positions, segment_ids)
      # lax.scan walks the leading axis; the stack lives on param_scan_axis.
      state = jax.tree.map(lambda a: jnp.moveaxis(a, cfg.param_scan_axis, 0), state)
      x, _ = jax.lax.scan(lambda carry, layer: (step(layer, carry), None), x, state)
    else:
      for i in range(cfg.num_decoder_layers):
        graphdef, state = nnx.split(getattr(self, f"layers_{i}"))
        x = _layer_step(graphdef, cfg, positions, segment_ids)(state, x)
    x = self.decoder_norm(x)
    self.sow(nnx.Intermediate, "hidden_states", x)
    if cfg.logits_via_embedding:
      return embedding_ops.attend(x, embedding, dtype=jnp.dtype(cfg.dtype))
    return self.logits_dense(x).astype(jnp.float32)


def _layer_step(graphdef, cfg: Config, positions: jax.Array, segment_ids: jax.Array):
  """(layer state, x) -> x as a pure function, so jax.checkpoint and lax.scan see plain arrays."""

  def step(state, x):
    x, _ = nnx.merge(graphdef, state)(x, positions, segment_ids)
    return x

  if cfg.remat_policy == "none":
    return step
  # prevent_cse only matters outside scan, where XLA could otherwise merge the
  # recomputation back into the forward pass (the same choice nn.remat gets).
  return jax.checkpoint(
      step, policy=remat.checkpoint_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers
  )
