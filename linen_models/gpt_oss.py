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

from linen_models.attention import Attention
from linen_models.linears import dense
from linen_models.mixtral import moe_per_layer
from linen_models.moe import expert_weight
from linen_models.normalizations import norm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import gpt_oss
from maxbridge.ops import mlp
from maxbridge.ops import moe as moe_ops
from maxbridge.ops import quantization


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


def activation(config: Config):
  """The experts' clamped SwiGLU; `mlp_activations_limit` 0 clamps nothing."""
  return functools.partial(
      mlp.clamped_swiglu, alpha=gpt_oss.SWIGLU_ALPHA, limit=config.mlp_activations_limit or float("inf")
  )


class GptOssDecoderLayer(nn.Module):
  config: Config
  local: bool = False  # the sliding-window one (`gpt_oss.attention`)

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_layer_norm")(x)
    attended, per_layer = Attention(cfg, self.local, name="self_attention")(h, positions, segment_ids)
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
      x, values = GptOssDecoderLayer(cfg, name != gpt_oss.GLOBAL, name=name)(x, positions, segment_ids)
      losses += [values["moe_lb_losses"]] if "moe_lb_losses" in values else []
    # The block's mean: the decoder's mean over blocks is then the mean over layers.
    return x, {"moe_lb_losses": jnp.mean(jnp.stack(losses))} if losses else {}
