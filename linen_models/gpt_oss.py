"""gpt-oss's decoder layer and its block of two (the canonical tree's layout: `maxbridge.core.families.gpt_oss`).

x + attention(norm(x)), then x + experts(norm(x)), as Llama's layer. The
attention has biased projections and a sink logit per query head; the experts
(`MoeBlock_0`) a biased router and biased, fused gate/up kernels. A stacked
unit is a block of a sliding-window layer (`local`) and a full one (`global`),
as MaxText's GptOssScannableBlock.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention import read_cache
from linen_models.linears import dense
from linen_models.mixtral import moe_per_layer
from linen_models.moe import expert_weight
from linen_models.normalizations import norm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import gpt_oss
from maxbridge.ops import attention, kv_cache, mlp, rotary
from maxbridge.ops import moe as moe_ops
from maxbridge.ops import quantization


class GptOssAttention(nn.Module):
  """Grouped-query attention with q/k/v/o biases, per-head `sinks`, and this layer's own window (0: full)."""

  config: Config
  sliding_window_size: int = 0

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    biased = dict(use_bias=True)
    query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), name="query", **biased)(x)
    kv_axes = ("embed", "kv_heads", "kv_head_dim")
    key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), kv_axes, name="key", **biased)(x)
    value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), kv_axes, name="value", **biased)(x)
    sinks = self.param(
        "sinks", nn.with_logical_partitioning(initializers.placeholder, ("heads",)), (heads,), jnp.dtype(cfg.weight_dtype)
    )
    rope = dict(max_timescale=cfg.rope_max_timescale, scaling=rotary.scaling_from_config(cfg))
    query = rotary.apply_rotary(query, positions, **rope)
    key = rotary.apply_rotary(key, positions, **rope)
    (key, value), kv, write_cache = read_cache(
        self, {"cached_key": key, "cached_value": value}, positions, segment_ids, ring=bool(kv_cache.window(cfg))
    )
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=self.sliding_window_size,
        query_scale=head_dim**-0.5,
        with_max_logits=cfg.use_qk_clip,
        sinks=sinks,
        **kv,
    )
    write_cache(out)
    out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), name="out", **biased)(out)
    return out, per_layer


class GptOssMoE(nn.Module):
  """Routed experts: a biased router `gate`, then wo(clamped_swiglu(x wi + wi_bias)) + wo_bias per expert."""

  config: Config
  dot_general: moe_ops.DotGeneral | None = None  # None: the config's (`quantization`)
  ragged_dot: moe_ops.RaggedDot | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, cfg.mlp_dim
    dot_general = quantization.expert_dot_general(cfg, self.dot_general or quantization.linen_dot_general(cfg))
    # The router multiplies by the config's matmul, as every family's (and MaxText's) does, and keeps a
    # float kernel in serve checkpoints, as the other families' gates do.
    router = dict(dot_general=dot_general, frozen=None)
    logits = dense(cfg, (width,), (experts,), ("embed", None), use_bias=True, name="gate", **router)(x)

    def bias(name, shape, axes):
      partitioned = nn.with_logical_partitioning(initializers.placeholder, axes)
      return self.param(name, partitioned, shape, jnp.dtype(cfg.weight_dtype))

    return moe_ops.biased_routed_moe(
        x,
        logits,
        expert_weight(self, cfg, "wi", (experts, width, 2 * hidden), ("exp", "embed_no_exp", "mlp")),
        bias("wi_bias", (experts, 2 * hidden), ("exp", "mlp")),
        expert_weight(self, cfg, "wo", (experts, hidden, width), ("exp", "mlp", "embed_no_exp")),
        bias("wo_bias", (experts, width), ("exp", "embed_no_exp")),
        activation=activation(cfg),
        num_experts_per_tok=cfg.num_experts_per_tok,
        sparse=cfg.sparse_matmul,
        load_balance_loss_weight=cfg.load_balance_loss_weight,
        dtype=jnp.dtype(cfg.dtype),
        dot_general=dot_general,
        ragged_dot=self.ragged_dot or quantization.ragged_dot(cfg),
    )


def activation(cfg: Config):
  """The experts' clamped SwiGLU; `mlp_activations_limit` 0 clamps nothing."""
  return functools.partial(
      mlp.clamped_swiglu, alpha=gpt_oss.SWIGLU_ALPHA, limit=cfg.mlp_activations_limit or float("inf")
  )


class GptOssDecoderLayer(nn.Module):
  config: Config
  sliding_window_size: int = 0

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_layer_norm")(x)
    attended, per_layer = GptOssAttention(cfg, self.sliding_window_size, name="self_attention")(h, positions, segment_ids)
    x = x + attended
    out, loss = GptOssMoE(cfg, name="MoeBlock_0")(norm(cfg, name="post_self_attention_layer_norm")(x))
    return x + out, {**per_layer, **moe_per_layer(loss)}


class GptOssBlock(nn.Module):
  """A sliding-window layer then a full one: the unit the decoder stacks (`Stack.sublayers`)."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    losses = []
    for name in gpt_oss.SUBLAYERS:
      window = 0 if name == gpt_oss.GLOBAL else cfg.sliding_window_size
      x, values = GptOssDecoderLayer(cfg, window, name=name)(x, positions, segment_ids)
      losses += [values["moe_lb_losses"]] if "moe_lb_losses" in values else []
    # The block's mean: the decoder's mean over blocks is then the mean over layers.
    return x, {"moe_lb_losses": jnp.mean(jnp.stack(losses))} if losses else {}
