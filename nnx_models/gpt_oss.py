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
from maxbridge.ops import mlp
from maxbridge.ops import moe as moe_ops
from maxbridge.ops import quantization
from nnx_models import Module
from nnx_models.attention import Attention
from nnx_models.linears import dense
from nnx_models.mixtral import moe_per_layer
from nnx_models.moe import add_expert_weight, expert_weight
from nnx_models.normalizations import norm


class GptOssMoE(Module):
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


def activation(config: Config):
  """The experts' clamped SwiGLU; `mlp_activations_limit` 0 clamps nothing."""
  return functools.partial(
      mlp.clamped_swiglu, alpha=gpt_oss.SWIGLU_ALPHA, limit=config.mlp_activations_limit or float("inf")
  )


class GptOssDecoderLayer(Module):

  def __init__(self, config: Config, local: bool = False, *, rngs: nnx.Rngs):
    self.pre_self_attention_layer_norm = norm(config, rngs=rngs)
    self.self_attention = Attention(config, local, rngs=rngs)  # local: the sliding-window one
    self.post_self_attention_layer_norm = norm(config, rngs=rngs)
    self.MoeBlock_0 = GptOssMoE(config, rngs=rngs)  # pylint: disable=invalid-name

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    attended, per_layer = self.self_attention(self.pre_self_attention_layer_norm(x), positions, segment_ids)
    x = x + attended
    out, loss = self.MoeBlock_0(self.post_self_attention_layer_norm(x))
    return x + out, {**per_layer, **moe_per_layer(loss)}


class GptOssBlock(Module):
  """A sliding-window layer then a full one: the unit the decoder stacks (`Stack.sublayers`)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for name in gpt_oss.SUBLAYERS:
      setattr(self, name, GptOssDecoderLayer(config, name != gpt_oss.GLOBAL, rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    losses = []
    for name in gpt_oss.SUBLAYERS:
      x, values = getattr(self, name)(x, positions, segment_ids)
      losses += [values["moe_lb_losses"]] if "moe_lb_losses" in values else []
    # The block's mean: the decoder's mean over blocks is then the mean over layers.
    return x, {"moe_lb_losses": jnp.mean(jnp.stack(losses))} if losses else {}
