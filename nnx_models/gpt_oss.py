"""gpt-oss's decoder layer and its block of two (the canonical tree's layout: `maxbridge.core.families.gpt_oss`).

x + attention(norm(x)), then x + experts(norm(x)), as Llama's layer. The
attention has biased projections and a sink logit per query head; the experts
(`MoeBlock_0`) a biased router and biased, fused gate/up kernels. A stacked
unit is a block of a sliding-window layer (`local`) and a full one (`global`),
as MaxText's GptOssScannableBlock.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import gpt_oss
from maxbridge.ops import attention, kv_cache, mlp, rotary
from maxbridge.ops import moe as moe_ops
from maxbridge.ops import quantization
from nnx_models.attention import read_cache
from nnx_models.linears import dense
from nnx_models.mixtral import moe_per_layer
from nnx_models.moe import add_expert_weight, expert_weight
from nnx_models.normalizations import norm


class GptOssAttention(nnx.Module):
  """Grouped-query attention with q/k/v/o biases, per-head `sinks`, and this layer's own window (0: full)."""

  def __init__(self, config: Config, sliding_window_size: int = 0, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.window = sliding_window_size
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    kv_axes = ("embed", "kv_heads", "kv_head_dim")
    biased = dict(use_bias=True, rngs=rngs)
    self.query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), **biased)
    self.key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), kv_axes, **biased)
    self.value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), kv_axes, **biased)
    self.sinks = nnx.Param(
        initializers.placeholder(rngs.params(), (heads,), jnp.dtype(cfg.weight_dtype)), out_sharding=("heads",)
    )
    self.out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), **biased)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    rope = dict(max_timescale=cfg.rope_max_timescale, scaling=rotary.scaling_from_config(cfg))
    query = rotary.apply_rotary(self.query(x), positions, **rope)
    key = rotary.apply_rotary(self.key(x), positions, **rope)
    (key, value), kv, write_cache = read_cache(
        self, {"cached_key": key, "cached_value": self.value(x)}, positions, segment_ids, ring=bool(kv_cache.window(cfg))
    )
    out, per_layer = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=self.window,
        query_scale=cfg.head_dim**-0.5,
        with_max_logits=cfg.use_qk_clip,
        sinks=self.sinks[...],
        **kv,
    )
    write_cache(out)
    return self.out(out), per_layer


class GptOssMoE(nnx.Module):
  """Routed experts: a biased router `gate`, then wo(clamped_swiglu(x wi + wi_bias)) + wo_bias per expert."""

  def __init__(
      self,
      config: Config,
      dot_general: moe_ops.DotGeneral | None = None,  # None: the config's (`quantization`)
      ragged_dot: moe_ops.RaggedDot | None = None,
      *,
      rngs: nnx.Rngs,
  ):
    cfg = self.config = config
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, cfg.mlp_dim
    dot_general = quantization.expert_dot_general(cfg, dot_general or quantization.nnx_dot_general(cfg))
    # The router multiplies by the config's matmul, as every family's (and MaxText's) does, and keeps a
    # float kernel in serve checkpoints, as the other families' gates do.
    router = dict(dot_general=dot_general, frozen=None)
    self.gate = dense(cfg, (width,), (experts,), ("embed", None), use_bias=True, rngs=rngs, **router)

    def bias(shape, axes):
      return nnx.Param(initializers.placeholder(rngs.params(), shape, jnp.dtype(cfg.weight_dtype)), out_sharding=axes)

    add_expert_weight(self, cfg, "wi", (experts, width, 2 * hidden), ("exp", "embed_no_exp", "mlp"), rngs)
    self.wi_bias = bias((experts, 2 * hidden), ("exp", "mlp"))
    add_expert_weight(self, cfg, "wo", (experts, hidden, width), ("exp", "mlp", "embed_no_exp"), rngs)
    self.wo_bias = bias((experts, width), ("exp", "embed_no_exp"))
    self.dot_general = dot_general
    self.ragged_dot = ragged_dot or quantization.ragged_dot(cfg)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    return moe_ops.biased_routed_moe(
        x,
        self.gate(x),
        expert_weight(self, cfg, "wi"),
        self.wi_bias[...],
        expert_weight(self, cfg, "wo"),
        self.wo_bias[...],
        activation=activation(cfg),
        num_experts_per_tok=cfg.num_experts_per_tok,
        sparse=cfg.sparse_matmul,
        load_balance_loss_weight=cfg.load_balance_loss_weight,
        dtype=jnp.dtype(cfg.dtype),
        dot_general=self.dot_general,
        ragged_dot=self.ragged_dot,
    )


def activation(cfg: Config):
  """The experts' clamped SwiGLU; `mlp_activations_limit` 0 clamps nothing."""
  return functools.partial(
      mlp.clamped_swiglu, alpha=gpt_oss.SWIGLU_ALPHA, limit=cfg.mlp_activations_limit or float("inf")
  )


class GptOssDecoderLayer(nnx.Module):

  def __init__(self, config: Config, sliding_window_size: int = 0, *, rngs: nnx.Rngs):
    self.pre_self_attention_layer_norm = norm(config, rngs=rngs)
    self.self_attention = GptOssAttention(config, sliding_window_size, rngs=rngs)
    self.post_self_attention_layer_norm = norm(config, rngs=rngs)
    self.MoeBlock_0 = GptOssMoE(config, rngs=rngs)  # pylint: disable=invalid-name

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    attended, per_layer = self.self_attention(self.pre_self_attention_layer_norm(x), positions, segment_ids)
    x = x + attended
    out, loss = self.MoeBlock_0(self.post_self_attention_layer_norm(x))
    return x + out, {**per_layer, **moe_per_layer(loss)}


class GptOssBlock(nnx.Module):
  """A sliding-window layer then a full one: the unit the decoder stacks (`Stack.sublayers`)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for name in gpt_oss.SUBLAYERS:
      window = 0 if name == gpt_oss.GLOBAL else config.sliding_window_size
      setattr(self, name, GptOssDecoderLayer(config, window, rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    losses = []
    for name in gpt_oss.SUBLAYERS:
      x, values = getattr(self, name)(x, positions, segment_ids)
      losses += [values["moe_lb_losses"]] if "moe_lb_losses" in values else []
    # The block's mean: the decoder's mean over blocks is then the mean over layers.
    return x, {"moe_lb_losses": jnp.mean(jnp.stack(losses))} if losses else {}
