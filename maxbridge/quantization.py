"""Quantization: the config's `quantization` keys turned into what each backend's layers take.

Every weight matmul of the models goes through the `dot_general` of a
`DenseGeneral` built by one constructor per backend (`linears.dense`); this
module decides that `dot_general`, so no layer holds a quantization branch.

AQT (`use_qwix_quantization=false`, `quantization=int8`), train mode: the
kernel stays float and is quantized on the fly in every matmul (forward and
both gradients, int8 with int32 accumulation, MaxText's int8 recipe).
Linen layers take `aqt_flax.AqtDotGeneral`; NNX layers call the same AQT
`DotGeneral` config directly, which is pure JAX and needs no Linen detour. Both
run AQT's `dg_core_vjp_fwd` / `dg_core_vjp_bwd`, so the two backends give the
same numbers. Gradients are rounded to nearest, not stochastically: no
random key is needed, so a step is a pure function of state and batch.

Qwix (`use_qwix_quantization=true`) intercepts the matmuls of a whole model,
so layers need no hook at all: `dispatch` hands the top-level model to
`quantize_linen` or `quantize_nnx`. QAT only (weights quantized on the fly, no
state beyond the float model's), for pure Linen or pure NNX flags: Qwix finds
a matmul's weights and rule by the module running it, which a ToNNX/ToLinen
boundary hides (config validation says so).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from aqt.jax.v2 import aqt_dot_general
from aqt.jax.v2 import config as aqt_config
from aqt.jax.v2.flax import aqt_flax
import qwix

from maxbridge.config import Config
from maxbridge.ops import linear


def is_quantized(config: Config) -> bool:
  return bool(config.quantization)


def uses_aqt(config: Config) -> bool:
  return is_quantized(config) and not config.use_qwix_quantization


@functools.lru_cache(maxsize=8)
def _aqt_int8(local_shard_count: int) -> aqt_dot_general.DotGeneral:
  # MaxText's int8: forward and input gradient in int8; the weight gradient in
  # int8 per local shard of the contracted (batch) axis, or float when 0.
  shards = 1 if local_shard_count == -1 else local_shard_count
  drhs = dict(drhs_bits=None, drhs_local_aqt=None, drhs_accumulator_dtype=None)
  if shards:
    drhs = dict(
        drhs_bits=8,
        drhs_local_aqt=aqt_dot_general.LocalAqt(contraction_axis_shard_count=shards),
        drhs_accumulator_dtype=jnp.int32,
    )
  cfg = aqt_config.config_v3(
      fwd_bits=8,
      dlhs_bits=8,
      fwd_accumulator_dtype=jnp.int32,
      dlhs_accumulator_dtype=jnp.int32,
      **drhs,
  )
  aqt_config.set_stochastic_rounding(cfg, False, False, "jax.uniform")
  return cfg


def aqt_dot_general_config(config: Config) -> aqt_dot_general.DotGeneral:
  """The AQT `DotGeneral` config for `config` (int8 only: AQT takes no other `quantization`)."""
  if config.quantization != "int8":
    raise ValueError(f"AQT quantizes to int8 only, got quantization={config.quantization!r}")
  return _aqt_int8(config.quantization_local_shard_count)


def linen_dot_general(config: Config) -> linear.DotGeneral:
  """The `dot_general` of a Linen `DenseGeneral` for `config`: a fresh module per layer when quantized.

  `parent=None` detaches the module from whichever layer is being built, so
  the `DenseGeneral` it is given to adopts it (as its child `dot_general`).
  """
  if not uses_aqt(config):
    return jax.lax.dot_general
  return aqt_flax.AqtDotGeneral(aqt_dot_general_config(config), prng_name=None, parent=None)


def nnx_dot_general(config: Config) -> linear.DotGeneral:
  """The `dot_general` of an NNX `DenseGeneral` for `config`: AQT's config, called as a function."""
  if not uses_aqt(config):
    return jax.lax.dot_general
  return aqt_config.set_context(aqt_dot_general_config(config), key=None, train_step=None)


# --- Qwix (use_qwix_quantization=true): interception, no hook in the layers -------


def uses_qwix(config: Config) -> bool:
  return is_quantized(config) and config.use_qwix_quantization


def qwix_rules(config: Config) -> list:
  """Qwix QAT rules, MaxText's: every weight matmul of the decoder; the embedding lookup stays float.

  Only `dot_general` ops are rules' targets: the attention einsums multiply
  activations by activations, which MaxText's Qwix recipes leave in float.
  """
  q = config.quantization
  common = dict(module_path="decoder/.*", op_names=("dot_general",))
  if q == "int8":  # weights and activations, gradients too
    return [qwix.QtRule(weight_qtype=jnp.int8, act_qtype=jnp.int8, bwd_qtype=jnp.int8, **common)]
  if q == "int4":  # weight-only
    return [qwix.QtRule(weight_qtype=jnp.int4, **common)]
  if q == "fp8":  # e4m3 forward, e5m2 backward
    return [qwix.QtRule(weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2, **common)]
  raise ValueError(f"Qwix quantization {q!r} is not built; valid values: 'int8', 'int4', 'fp8'")


def quantize_linen(config: Config, module: nn.Module) -> nn.Module:
  """`module` with its matmuls intercepted by Qwix when `config` asks for Qwix, else `module`."""
  if not uses_qwix(config):
    return module
  return qwix.quantize_model(module, qwix.QtProvider(qwix_rules(config)))


def quantize_nnx(config: Config, module: nnx.Module, *sample_inputs) -> nnx.Module:
  """`module` quantized by Qwix when `config` asks for Qwix, else `module`.

  Qwix runs one eager forward pass on `sample_inputs` to set the model up;
  what that pass sows is popped, so the state is the float model's plus any
  quantization state, never intermediates.
  """
  if not uses_qwix(config):
    return module
  quantized = qwix.quantize_model(module, qwix.QtProvider(qwix_rules(config)), *sample_inputs)
  nnx.pop(quantized, nnx.Intermediate)
  return quantized
