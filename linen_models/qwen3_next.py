"""Qwen3-Next's layers (the canonical tree's layout: `maxbridge.core.families.qwen3_next`).

A block (`Qwen3NextBlock`, what the decoder stacks) is three gated DeltaNet
layers then one gated full-attention layer; each layer ends in routed experts
plus a sigmoid-gated shared expert.

Decoding: given a "cache" collection (`maxbridge.models.decoding`), the
attention layer appends to its KV cache (`read_cache`) and a DeltaNet layer
continues its `recurrent_state` and `conv_window`; training passes none.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention import Attention
from linen_models.linears import dense
from linen_models.mixtral import moe_per_layer
from linen_models.mlp import MlpBlock
from linen_models.moe import RoutedMoE
from linen_models.normalizations import norm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import qwen3_next
from maxbridge.ops import gated_deltanet, kv_cache

STATE, WINDOW = kv_cache.RECURRENT_STATE, kv_cache.CONV_WINDOW  # a DeltaNet layer's decode state


class _Weight(nn.Module):
  """One parameter, `kernel` or `scale`, returned as it is: the DeltaNet's convolution kernel and gated norm weight."""

  config: Config
  param_name: str
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]

  @nn.compact
  def __call__(self) -> jax.Array:
    partitioned = nn.with_logical_partitioning(initializers.placeholder, self.axes)
    return self.param(self.param_name, partitioned, self.shape, jnp.dtype(self.config.weight_dtype))


class GatedDeltaNet(nn.Module):
  """The linear-attention mixer: projections around `ops.gated_deltanet.mixer`."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    cfg = self.config
    key_heads, value_heads = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    groups = qwen3_next.value_groups(cfg)
    qkvz = dense(
        cfg, (cfg.emb_dim,), (key_heads, qwen3_next.qkvz_width(cfg)), ("embed", "kv_heads", None), name="in_proj_qkvz"
    )(x)
    ba = dense(cfg, (cfg.emb_dim,), (key_heads, 2 * groups), ("embed", "kv_heads", None), name="in_proj_ba")(x)
    conv_kernel = _Weight(
        cfg, "kernel", (cfg.gdn_conv_kernel_dim, qwen3_next.conv_channels(cfg)), (None, None), name="conv1d"
    )()
    norm_scale = _Weight(cfg, "scale", (cfg.gdn_value_head_dim,), ("norm",), name="norm")()
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    a_log = self.param(
        "A_log", nn.with_logical_partitioning(initializers.placeholder, (None,)), (value_heads,), weight_dtype
    )
    dt_bias = self.param(
        "dt_bias", nn.with_logical_partitioning(initializers.placeholder, (None,)), (value_heads,), weight_dtype
    )
    decoding = self.has_variable("cache", STATE)
    out, state, window = gated_deltanet.mixer(
        qkvz,
        ba,
        conv_kernel,
        a_log,
        dt_bias,
        norm_scale,
        segment_ids,
        key_dim=cfg.gdn_key_head_dim,
        epsilon=cfg.normalization_layer_epsilon,
        chunk_size=cfg.gdn_chunk_size,
        state=self.get_variable("cache", STATE) if decoding else None,
        window=self.get_variable("cache", WINDOW) if decoding else None,
    )
    if decoding:
      self.put_variable("cache", STATE, state)
      self.put_variable("cache", WINDOW, window.astype(self.get_variable("cache", WINDOW).dtype))
    out = out.astype(jnp.dtype(cfg.dtype))
    return dense(cfg, (value_heads, cfg.gdn_value_head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out_proj")(
        out
    )


class Qwen3NextLayer(nn.Module):
  """x + mixer(norm(x)), then x + experts(norm(x)) + sigmoid(shared_expert_gate(h)) * shared_expert(h), or x +
  mlp(norm(x)) in Qwen3.5's dense models."""

  config: Config
  linear: bool

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_layer_norm")(x)
    if self.linear:
      h = GatedDeltaNet(cfg, name="linear_attention")(h, positions, segment_ids)
    else:
      h, _ = Attention(cfg, name="self_attention")(h, positions, segment_ids)
    x = x + h
    h = norm(cfg, name="post_self_attention_layer_norm")(x)
    if not qwen3_next.routes(cfg):
      return x + MlpBlock(cfg, cfg.mlp_dim, name="mlp")(h), {}
    routed, loss = RoutedMoE(cfg, cfg.moe_mlp_dim, name="moe_block")(h)
    shared = MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, name="shared_expert")(h)
    gate = dense(cfg, (cfg.emb_dim,), (1,), ("embed", None), name="shared_expert_gate")(h)
    return x + routed + jax.nn.sigmoid(gate) * shared, moe_per_layer(loss)


class Qwen3NextBlock(nn.Module):
  """Three DeltaNet layers then a full-attention one (`qwen3_next.SUBLAYERS`): the unit the decoder stacks."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    losses = []
    for name in qwen3_next.SUBLAYERS:
      x, values = Qwen3NextLayer(self.config, qwen3_next.is_linear(name), name=name)(x, positions, segment_ids)
      losses += [values["moe_lb_losses"]] if "moe_lb_losses" in values else []
    # The block's mean: the decoder's mean over blocks is then the mean over layers.
    return x, {"moe_lb_losses": jnp.mean(jnp.stack(losses))} if losses else {}
