"""Qwen3-Next's layers (the canonical tree's layout: `maxbridge.core.families.qwen3_next`).

A block (`Qwen3NextBlock`, what the decoder stacks) is three gated DeltaNet
layers then one gated full-attention layer; each layer ends in routed experts
plus a sigmoid-gated shared expert.

Decoding: given `nnx.Cache` variables (`maxbridge.models.decoding`), the
attention layer appends to its KV cache (`read_cache`) and a DeltaNet layer
continues its `recurrent_state` and `conv_window`; a model built for training
has none.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import qwen3_next
from maxbridge.ops import gated_deltanet, kv_cache
from nnx_models import Module
from nnx_models.attention import Attention
from nnx_models.linears import dense
from nnx_models.mixtral import moe_per_layer
from nnx_models.mlp import MlpBlock
from nnx_models.moe import RoutedMoE
from nnx_models.normalizations import norm

STATE, WINDOW = kv_cache.RECURRENT_STATE, kv_cache.CONV_WINDOW  # a DeltaNet layer's decode state


class _Weight(Module):
  """One parameter, `kernel` or `scale`: the DeltaNet's convolution kernel and gated norm weight."""

  def __init__(self, config: Config, name: str, shape: tuple[int, ...], axes: tuple, *, rngs: nnx.Rngs):
    setattr(
        self,
        name,
        nnx.Param(initializers.placeholder(rngs.params(), shape, jnp.dtype(config.weight_dtype)), out_sharding=axes),
    )
    self.param_name = name

  def __call__(self) -> jax.Array:
    return getattr(self, self.param_name)[...]


class GatedDeltaNet(Module):
  """The linear-attention mixer: projections around `ops.gated_deltanet.mixer`."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    key_heads, value_heads = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    groups = qwen3_next.value_groups(cfg)
    self.in_proj_qkvz = dense(
        cfg, (cfg.emb_dim,), (key_heads, qwen3_next.qkvz_width(cfg)), ("embed", "kv_heads", None), rngs=rngs
    )
    self.in_proj_ba = dense(cfg, (cfg.emb_dim,), (key_heads, 2 * groups), ("embed", "kv_heads", None), rngs=rngs)
    self.conv1d = _Weight(
        cfg, "kernel", (cfg.gdn_conv_kernel_dim, qwen3_next.conv_channels(cfg)), (None, None), rngs=rngs
    )
    self.norm = _Weight(cfg, "scale", (cfg.gdn_value_head_dim,), ("norm",), rngs=rngs)
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    self.A_log = nnx.Param(  # pylint: disable=invalid-name
        initializers.placeholder(rngs.params(), (value_heads,), weight_dtype), out_sharding=(None,)
    )
    self.dt_bias = nnx.Param(initializers.placeholder(rngs.params(), (value_heads,), weight_dtype), out_sharding=(None,))
    self.out_proj = dense(cfg, (value_heads, cfg.gdn_value_head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    cfg = self.config
    decoding = hasattr(self, STATE)
    out, state, window = gated_deltanet.mixer(
        self.in_proj_qkvz(x),
        self.in_proj_ba(x),
        self.conv1d(),
        self.A_log[...],
        self.dt_bias[...],
        self.norm(),
        segment_ids,
        key_dim=cfg.gdn_key_head_dim,
        epsilon=cfg.normalization_layer_epsilon,
        chunk_size=cfg.gdn_chunk_size,
        state=getattr(self, STATE)[...] if decoding else None,
        window=getattr(self, WINDOW)[...] if decoding else None,
    )
    if decoding:
      getattr(self, STATE)[...] = state
      getattr(self, WINDOW)[...] = window.astype(getattr(self, WINDOW).dtype)
    return self.out_proj(out.astype(jnp.dtype(cfg.dtype)))


class Qwen3NextLayer(Module):
  """x + mixer(norm(x)), then x + experts(norm(x)) + sigmoid(shared_expert_gate(h)) * shared_expert(h), or x +
  mlp(norm(x)) in Qwen3.5's dense models."""

  def __init__(self, config: Config, linear: bool, *, rngs: nnx.Rngs):
    cfg = config
    self.pre_self_attention_layer_norm = norm(cfg, rngs=rngs)
    if linear:
      self.linear_attention = GatedDeltaNet(cfg, rngs=rngs)
    else:
      self.self_attention = Attention(cfg, rngs=rngs)
    self.post_self_attention_layer_norm = norm(cfg, rngs=rngs)
    self.routes = qwen3_next.routes(cfg)
    if self.routes:
      self.moe_block = RoutedMoE(cfg, cfg.moe_mlp_dim, rngs=rngs)
      self.shared_expert = MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, rngs=rngs)
      self.shared_expert_gate = dense(cfg, (cfg.emb_dim,), (1,), ("embed", None), rngs=rngs)
    else:
      self.mlp = MlpBlock(cfg, cfg.mlp_dim, rngs=rngs)
    self.linear = linear

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    h = self.pre_self_attention_layer_norm(x)
    if self.linear:
      x = x + self.linear_attention(h, positions, segment_ids)
    else:
      x = x + self.self_attention(h, positions, segment_ids)[0]
    h = self.post_self_attention_layer_norm(x)
    if not self.routes:
      return x + self.mlp(h), {}
    routed, loss = self.moe_block(h)
    shared = jax.nn.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
    return x + routed + shared, moe_per_layer(loss)


class Qwen3NextBlock(Module):
  """Three DeltaNet layers then a full-attention one (`qwen3_next.SUBLAYERS`): the unit the decoder stacks."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for name in qwen3_next.SUBLAYERS:
      setattr(self, name, Qwen3NextLayer(config, qwen3_next.is_linear(name), rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    losses = []
    for name in qwen3_next.SUBLAYERS:
      x, values = getattr(self, name)(x, positions, segment_ids)
      losses += [values["moe_lb_losses"]] if "moe_lb_losses" in values else []
    # The block's mean: the decoder's mean over blocks is then the mean over layers.
    return x, {"moe_lb_losses": jnp.mean(jnp.stack(losses))} if losses else {}
