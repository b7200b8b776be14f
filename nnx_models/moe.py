"""Mixture-of-experts blocks, named as MaxText's: `MoeBlock_0` (routed), `DeepSeekMoeBlock_0`.

Routed experts keep bare [experts, in, out] parameters `wi_0`, `wi_1`, `wo`
beside a `gate` router; all routing and expert math is `maxbridge.ops.moe`.
A block returns (output, load-balancing loss or None).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge import initializers
from maxbridge.config import Config
from maxbridge.ops import linear
from maxbridge.ops import moe as moe_ops
from nnx_models.mlp import MlpBlock


class GateLogit(nnx.Module):
  """Router logits x @ kernel [D, E]; with `routed_bias`, DeepSeek's score-correction `bias` [E]."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    self.kernel = nnx.Param(
        initializers.kernel()(rngs.params(), (cfg.emb_dim, cfg.num_experts), weight_dtype),
        out_sharding=("embed", None),
    )
    if cfg.routed_bias:
      self.bias = nnx.Param(initializers.zeros()(rngs.params(), (cfg.num_experts,), weight_dtype), out_sharding=(None,))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    bias = self.bias[...] if cfg.routed_bias else None
    return linear.dense_general(x, self.kernel[...], in_ndim=1, dtype=jnp.dtype(cfg.dtype)), bias


class RoutedMoE(nnx.Module):

  def __init__(self, config: Config, intermediate_dim: int, *, rngs: nnx.Rngs):
    cfg = self.config = config
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, intermediate_dim
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    self.gate = GateLogit(cfg, rngs=rngs)

    def expert_param(shape, axes):
      return nnx.Param(initializers.expert_kernel()(rngs.params(), shape, weight_dtype), out_sharding=axes)

    self.wi_0 = expert_param((experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    self.wi_1 = expert_param((experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    self.wo = expert_param((experts, hidden, width), ("exp", "mlp", "embed_no_exp"))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    logits, correction_bias = self.gate(x)
    return moe_ops.routed_moe(
        x,
        logits,
        correction_bias,
        self.wi_0[...],
        self.wi_1[...],
        self.wo[...],
        **moe_options(self.config),
    )


class RoutedAndSharedMoE(nnx.Module):
  """DeepSeek's block: routed experts (`MoeBlock_0`) plus always-on `shared_experts`."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    self.MoeBlock_0 = RoutedMoE(cfg, cfg.moe_mlp_dim, rngs=rngs)  # pylint: disable=invalid-name
    self.shared_experts = MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    routed, aux = self.MoeBlock_0(x)
    return routed + self.shared_experts(x), aux


def moe_options(cfg: Config) -> dict:
  """The config's routing settings, as `ops.moe.routed_moe` takes them."""
  return dict(
      num_experts_per_tok=cfg.num_experts_per_tok,
      score_func=cfg.routed_score_func,
      n_groups=cfg.n_routing_groups,
      top_groups=cfg.topk_routing_group,
      scaling_factor=cfg.routed_scaling_factor,
      sparse=cfg.sparse_matmul,
      load_balance_loss_weight=cfg.load_balance_loss_weight,
      dtype=jnp.dtype(cfg.dtype),
  )
