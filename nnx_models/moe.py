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
from nnx_models import Module
from nnx_models.mlp import MlpBlock


def add_expert_weight(
    module: nnx.Module, config: Config, name: str, shape: tuple[int, ...], axes: tuple[str, ...], rngs: nnx.Rngs
) -> None:
  """A routed-expert [E, in, out] weight on `module`: the float parameter `name`, or serving
  (`checkpoint_is_quantized`), its frozen `{name}_qvalue` and `{name}_scale`. `expert_weight` reads it."""

  def param(shape, axes, dtype):
    return nnx.Param(initializers.placeholder(rngs.params(), shape, jnp.dtype(dtype)), out_sharding=axes)

  if not quantization.serves_quantized(config):
    setattr(module, name, param(shape, axes, config.weight_dtype))
    return
  setattr(module, name + quantization.QVALUE_SUFFIX, param(shape, axes, quantization.qvalue_dtype(config)))
  scale = param(
      quantization.expert_scale_shape(config, shape), quantization.expert_scale_axes(config, axes), config.dtype
  )
  setattr(module, name + quantization.SCALE_SUFFIX, scale)


def expert_weight(module: nnx.Module, config: Config, name: str):
  """What `add_expert_weight` added: the float array, or the `quantization.FrozenExperts` pair."""
  if not quantization.serves_quantized(config):
    return getattr(module, name)[...]
  qvalue, scale = (getattr(module, name + suffix)[...] for suffix in quantization.SUFFIXES)
  return quantization.FrozenExperts(qvalue, scale)


class GateLogit(Module):
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


class RoutedMoE(Module):

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
    dot_general = quantization.expert_dot_general(cfg, dot_general or quantization.nnx_dot_general(cfg))
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, intermediate_dim
    self.gate = GateLogit(cfg, dot_general, rngs=rngs)
    add_expert_weight(self, cfg, "wi_0", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"), rngs)
    add_expert_weight(self, cfg, "wi_1", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"), rngs)
    add_expert_weight(self, cfg, "wo", (experts, hidden, width), ("exp", "mlp", "embed_no_exp"), rngs)
    self.dot_general = dot_general
    self.ragged_dot = ragged_dot or quantization.ragged_dot(cfg)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    logits, correction_bias = self.gate(x)
    return moe_ops.routed_moe(
        x,
        logits,
        correction_bias,
        *(expert_weight(self, self.config, name) for name in ("wi_0", "wi_1", "wo")),
        dot_general=self.dot_general,
        ragged_dot=self.ragged_dot,
        **moe_ops.moe_options(self.config),
    )


class RoutedAndSharedMoE(Module):
  """DeepSeek's block: routed experts (`MoeBlock_0`) plus always-on `shared_experts`."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    self.MoeBlock_0 = RoutedMoE(cfg, cfg.moe_mlp_dim, rngs=rngs)  # pylint: disable=invalid-name
    self.shared_experts = MlpBlock(cfg, cfg.shared_experts * cfg.moe_mlp_dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    routed, aux = self.MoeBlock_0(x)
    return routed + self.shared_experts(x), aux
