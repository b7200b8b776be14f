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
"""

import functools

import jax
import jax.numpy as jnp
from aqt.jax.v2 import aqt_dot_general
from aqt.jax.v2 import config as aqt_config
from aqt.jax.v2.flax import aqt_flax

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
