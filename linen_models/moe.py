"""Mixture-of-experts blocks, named as MaxText's: `MoeBlock_0` (routed), `DeepSeekMoeBlock_0`.

Routed experts keep bare [experts, in, out] parameters `wi_0`, `wi_1`, `wo`
beside a `gate` router; all routing and expert math is `maxbridge.ops.moe`.
A block returns (output, load-balancing loss or None). The router and the
experts take injectable matmuls (`dot_general`, and `ragged_dot` for the
dropless experts), by default the config's quantized ones, as `DenseGeneral`
does.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.mlp import MlpBlock
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.ops import linear
from maxbridge.ops import moe as moe_ops
from maxbridge.ops import quantization


def expert_weight(module: nn.Module, config: Config, name: str, shape: tuple[int, ...], axes: tuple[str, ...]):
  """A routed-expert [E, in, out] weight of `module`: the float parameter, or serving (`checkpoint_is_quantized`),
  its frozen `{name}_qvalue` and `{name}_scale` (`quantization.FrozenExperts`)."""

  def param(name, shape, axes, dtype):
    return module.param(name, nn.with_logical_partitioning(initializers.placeholder, axes), shape, jnp.dtype(dtype))

  if not quantization.serves_quantized(config):
    return param(name, shape, axes, config.weight_dtype)
  return quantization.FrozenExperts(
      param(name + quantization.QVALUE_SUFFIX, shape, axes, quantization.qvalue_dtype(config)),
      param(
          name + quantization.SCALE_SUFFIX,
          quantization.expert_scale_shape(config, shape),
          quantization.expert_scale_axes(config, axes),
          config.dtype,
      ),
  )


class GateLogit(nn.Module):
  """Router logits x @ kernel [D, E]; with `routed_bias`, DeepSeek's score-correction `bias` [E]."""

  config: Config
  dot_general: linear.DotGeneral = jax.lax.dot_general

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(initializers.placeholder, ("embed", None)),
        (cfg.emb_dim, cfg.num_experts),
        weight_dtype,
    )
    bias = None
    if cfg.routed_bias:
      bias = self.param(
          "bias",
          nn.with_logical_partitioning(initializers.placeholder, (None,)),
          (cfg.num_experts,),
          weight_dtype,
      )
    logits = linear.dense_general(x, kernel, in_ndim=1, dtype=jnp.dtype(cfg.dtype), dot_general=self.dot_general)
    return logits, bias


class RoutedMoE(nn.Module):
  config: Config
  intermediate_dim: int
  dot_general: linear.DotGeneral | None = None  # None: the config's (`quantization`)
  ragged_dot: moe_ops.RaggedDot | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, self.intermediate_dim
    dot_general = quantization.expert_dot_general(cfg, self.dot_general or quantization.linen_dot_general(cfg))
    logits, correction_bias = GateLogit(cfg, dot_general, name="gate")(x)
    wi_0 = expert_weight(self, cfg, "wi_0", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    wi_1 = expert_weight(self, cfg, "wi_1", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    wo = expert_weight(self, cfg, "wo", (experts, hidden, width), ("exp", "mlp", "embed_no_exp"))
    return moe_ops.routed_moe(
        x,
        logits,
        correction_bias,
        wi_0,
        wi_1,
        wo,
        dot_general=dot_general,
        ragged_dot=self.ragged_dot or quantization.ragged_dot(cfg),
        **moe_ops.moe_options(cfg),
    )


class RoutedAndSharedMoE(nn.Module):
  """DeepSeek's block: routed experts (`MoeBlock_0`) plus always-on `shared_experts`."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    cfg = self.config
    routed, aux = RoutedMoE(cfg, cfg.moe_mlp_dim, name="MoeBlock_0")(x)
    shared = MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, name="shared_experts")(x)
    return routed + shared, aux
