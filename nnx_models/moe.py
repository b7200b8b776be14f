"""Mixture-of-experts blocks, named as MaxText's: `MoeBlock_0` (routed), `DeepSeekMoeBlock_0`.

Routed experts keep bare [experts, in, out] parameters `wi_0`, `wi_1`, `wo`
beside a `gate` router; all routing and expert math is `maxbridge.ops.moe`.
A block returns (output, load-balancing loss or None). The router and the
experts take injectable matmuls (`dot_general`, and `ragged_dot` for the
dropless experts), by default the config's quantized ones, as `DenseGeneral`
does.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import linear
from maxbridge.ops import moe as moe_ops
from maxbridge.ops import quantization
from nnx_models.mlp import MlpBlock


class GateLogit(nnx.Module):
  """Router logits x @ kernel [D, E]; with `routed_bias`, DeepSeek's score-correction `bias` [E]."""

  def __init__(self, config: Config, dot_general: linear.DotGeneral = jax.lax.dot_general, *, rngs: nnx.Rngs):
    cfg = self.config = config
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    self.kernel = nnx.Param(
        initializers.placeholder(rngs.params(), (cfg.emb_dim, cfg.num_experts), weight_dtype),
        out_sharding=("embed", None),
    )
    if cfg.routed_bias:
      self.bias = nnx.Param(
          initializers.placeholder(rngs.params(), (cfg.num_experts,), weight_dtype), out_sharding=(None,)
      )
    self.dot_general = dot_general

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    bias = self.bias[...] if cfg.routed_bias else None
    logits = linear.dense_general(
        x, self.kernel[...], in_ndim=1, dtype=jnp.dtype(cfg.dtype), dot_general=self.dot_general
    )
    return logits, bias


class RoutedMoE(nnx.Module):

  def __init__(
      self,
      config: Config,
      intermediate_dim: int,
      dot_general: linear.DotGeneral | None = None,  # None: the config's (`quantization`)
      ragged_dot: moe_ops.RaggedDot | None = None,
      *,
      rngs: nnx.Rngs,
  ):
    cfg = self.config = config
    dot_general = dot_general or quantization.nnx_dot_general(cfg)
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, intermediate_dim
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    self.gate = GateLogit(cfg, dot_general, rngs=rngs)

    def expert_param(shape, axes):
      return nnx.Param(initializers.placeholder(rngs.params(), shape, weight_dtype), out_sharding=axes)

    self.wi_0 = expert_param((experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    self.wi_1 = expert_param((experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    self.wo = expert_param((experts, hidden, width), ("exp", "mlp", "embed_no_exp"))
    self.dot_general = dot_general
    self.ragged_dot = ragged_dot or quantization.ragged_dot(cfg)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    logits, correction_bias = self.gate(x)
    return moe_ops.routed_moe(
        x,
        logits,
        correction_bias,
        self.wi_0[...],
        self.wi_1[...],
        self.wo[...],
        dot_general=self.dot_general,
        ragged_dot=self.ragged_dot,
        **moe_ops.moe_options(self.config),
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
