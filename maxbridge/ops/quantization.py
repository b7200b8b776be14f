"""Quantization's matmuls: the config's `quantization` keys turned into what each backend's layers take.

Every weight matmul of the models goes through the `dot_general` of a
`DenseGeneral` built by one constructor per backend (`linears.dense`), or of
an MoE block (its router and experts; dropless experts take `ragged_dot`);
this module decides those matmuls, so no layer holds a quantization branch.
Which library and mode a config asks for is `maxbridge.core.quantization_policy`'s;
the Qwix internals the serving matmuls call, `qwix_private`'s.

AQT (`use_qwix_quantization=false`, `quantization=int8`), train mode: the
kernel stays float and is quantized on the fly in every matmul (forward and
both gradients, int8 with int32 accumulation, MaxText's int8 recipe).
Linen layers take `aqt_flax.AqtDotGeneral`; NNX layers call the same AQT
`DotGeneral` config directly, which is pure JAX and needs no Linen detour. Both
run AQT's `dg_core_vjp_fwd` / `dg_core_vjp_bwd`, so the two backends give the
same numbers. As in MaxText, a train step rounds the incoming gradient
stochastically; its key comes from the seed and the step (`stochastic_rounding`,
below), so a step is still a pure function of state and batch, on either
backend and after a resume. Forward passes round to nearest, and so does
everything outside a train step (eval, generate, serve): no key is needed.

Qwix (`use_qwix_quantization=true`) intercepts the matmuls of the decoder,
so layers need no hook at all: `dispatch` hands the decoder, in its own
backend, to `maxbridge.models.quantized` (`quantization_policy` holds the rules). QAT (weights quantized on the
fly, no state beyond the float model's) in every flag combination: Qwix finds
a matmul's weights and rule through the module running it, so it intercepts
below any ToNNX/ToLinen boundary, never across one, and every combination
gives pure Linen's numbers.

Serving (`checkpoint_is_quantized=true`, either library, any flags): dense
layers hold frozen `kernel_qvalue` + `kernel_scale` instead of `kernel`, and
MoE blocks `wi_0_qvalue` + `wi_0_scale` (and so on) instead of their experts
(see the section below); `maxbridge quantize` / `dispatch.quantize_params`
make them from float weights (AQT convert mode, or Qwix PTQ: the tree's
conversion is `maxbridge.models.quantized.serve_tree`). Routers keep
float kernels, quantized on the fly as in training.
"""

import contextlib
import contextvars
import copy
import dataclasses
import functools
import math
import zlib
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from aqt.jax.v2 import aqt_dot_general, aqt_ragged_dot, aqt_tensor
from aqt.jax.v2 import config as aqt_config
from aqt.jax.v2.flax import aqt_flax

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.core.quantization_policy import qwix_rules, serves_quantized, uses_aqt, uses_qwix
from maxbridge.ops import linear, moe, qwix_private


@functools.lru_cache(maxsize=16)
def _aqt_int8(local_shard_count: int, stochastic: bool) -> aqt_dot_general.DotGeneral:
  # MaxText's int8: forward and input gradient in int8; the weight gradient in
  # int8 per local shard of the contracted (batch) axis, or float when 0.
  # config_v3 rounds the incoming gradient (the lhs of both backward matmuls)
  # stochastically, with jax.uniform noise, as MaxText trains.
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
      rng_type="jax.uniform",
      **drhs,
  )
  if not stochastic:
    aqt_config.set_stochastic_rounding(cfg, False, False, "jax.uniform")
  return cfg


def aqt_dot_general_config(config: Config, stochastic: bool = False) -> aqt_dot_general.DotGeneral:
  """The AQT `DotGeneral` config for `config` (int8 only: AQT takes no other `quantization`).

  `stochastic`: gradients rounded stochastically (a train step's, which then needs a key), else to nearest.
  The forward pass rounds to nearest either way.
  """
  if config.quantization != "int8":
    raise ValueError(f"AQT quantizes to int8 only, got quantization={config.quantization!r}")
  return _aqt_int8(config.quantization_local_shard_count, stochastic)


# --- Stochastic rounding keys: from the train step, to each matmul -------------
#
# The train step sets its key (`stochastic_rounding`: the seed and the step
# only) in a context read while its gradient is traced, and each AQT matmul
# folds in a hash of its kernel's bits. Why a context: both bridges trace the
# wrapped module inside the caller's Python call, so it crosses ToNNX/ToLinen
# unchanged, and no layer's signature carries a key. Why not a Linen rng
# stream (AQT's default): its keys fold in Linen scope paths, which NNX cannot
# reproduce. Why the kernel's bits: they are the one id every backend and flag
# combination sees identically at the matmul (NNX modules do not know their
# path, Linen's differ behind ToNNX), and within a scanned stack, traced once
# for all layers, each layer's kernel slice still differs. So the noise is a
# pure function of (seed, step, weights): Linen, NNX and mixed flags draw the
# same, and a resumed run continues as if never stopped. The micro-batches of
# one step (gradient accumulation) share it. Outside a train step (eval,
# generate, serve) there is no key; a gradient taken there rounds to nearest.

_ROUNDING_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("rounding_key", default=None)
_ROUNDING_STREAM = zlib.crc32(b"aqt stochastic rounding")  # apart from the seed's other uses (LoRA dropout)


def rounding_key(config: Config, step: jax.Array) -> jax.Array:
  """A train step's stochastic-rounding key: the seed and the step only, so a resumed run (either backend) rounds alike."""
  seed_key = jax.random.fold_in(jax.random.key(config.seed), _ROUNDING_STREAM)
  return jax.random.fold_in(seed_key, jnp.asarray(step, jnp.uint32))


@contextlib.contextmanager
def stochastic_rounding(config: Config, step: jax.Array):
  """While a train step's gradient is traced: AQT rounds it stochastically, keyed by `rounding_key(config, step)`.

  A no-op unless `config` trains with AQT; the train step (`maxbridge.state`) enters it on both backends.
  """
  key = rounding_key(config, step) if uses_aqt(config) and not config.checkpoint_is_quantized else None
  token = _ROUNDING_KEY.set(key)
  try:
    yield
  finally:
    _ROUNDING_KEY.reset(token)


def _matmul_key(kernel: jax.Array) -> jax.Array | None:
  key = _ROUNDING_KEY.get()
  if key is None:
    return None
  # An integer sum wraps exactly, in any order or sharding: the same bits give the same hash.
  bits = jax.lax.bitcast_convert_type(jax.lax.stop_gradient(kernel), jnp.dtype(f"uint{kernel.dtype.itemsize * 8}"))
  return jax.random.fold_in(key, jnp.sum(bits, dtype=jnp.uint32))


class _KeyedAqtDotGeneral(aqt_flax.AqtDotGeneral):
  """`aqt_flax.AqtDotGeneral` given its key: AQT asks `make_rng` for it, which here reads no Linen rng stream."""

  key: jax.Array | None = None

  def make_rng(self, name: str = "params") -> jax.Array:
    del name
    return self.key


def _linen_aqt(local_shard_count: int, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  key = _matmul_key(rhs)
  # Made inside the calling layer's compact call: Linen adopts it as that layer's child (no variables in train mode).
  dot_general = _KeyedAqtDotGeneral(
      _aqt_int8(local_shard_count, key is not None), key=key, prng_name=None if key is None else "stochastic_rounding"
  )
  return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def _nnx_aqt(local_shard_count: int, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  key = _matmul_key(rhs)
  dot_general = aqt_config.set_context(_aqt_int8(local_shard_count, key is not None), key=key, train_step=None)
  return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def linen_dot_general(config: Config) -> linear.DotGeneral:
  """The `dot_general` of a Linen `DenseGeneral` for `config`: AQT's Linen module when quantized.

  The module is made per call, once its key (or none) is known: a Linen
  module takes no key as an argument, only through `make_rng`.
  """
  if not uses_aqt(config):
    return jax.lax.dot_general
  aqt_dot_general_config(config)  # checks the quantization
  return functools.partial(_linen_aqt, config.quantization_local_shard_count)


def nnx_dot_general(config: Config) -> linear.DotGeneral:
  """The `dot_general` of an NNX `DenseGeneral` for `config`: AQT's config, called as a function (pure JAX)."""
  if not uses_aqt(config):
    return jax.lax.dot_general
  aqt_dot_general_config(config)  # checks the quantization
  return functools.partial(_nnx_aqt, config.quantization_local_shard_count)


def ragged_dot(config: Config) -> moe.RaggedDot:
  """The `ragged_dot` of dropless routed experts for `config`: AQT's int8 one when AQT quantizes, else
  `jax.lax.ragged_dot` looked up when called (where Qwix intercepts it); serving, frozen experts' one."""
  if serves_quantized(config):
    return functools.partial(_frozen_ragged_dot, config)
  if not uses_aqt(config):
    return moe.lax_ragged_dot
  aqt_dot_general_config(config)  # checks the quantization
  return _aqt_ragged_dot


@jax.custom_vjp
def _aqt_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  # AQT's ragged_dot: int8 operands, int32 accumulation, one scale per output channel shared by all experts.
  # It writes its matmul into the config it is given, so each call takes its own copy.
  return aqt_ragged_dot.ragged_dot(lhs, rhs, group_sizes, cfg=copy.deepcopy(_aqt_int8(1, False)))


def _aqt_ragged_dot_fwd(lhs, rhs, group_sizes):
  return _aqt_ragged_dot(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _aqt_ragged_dot_bwd(residuals, grad):
  # AQT 0.9 quantizes ragged_dot's forward pass only: its backward would contract over the experts as a
  # dense matmul does. So the gradients are float ragged_dot's, straight through the rounding.
  lhs, rhs, group_sizes = residuals
  _, vjp = jax.vjp(lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, group_sizes), lhs, rhs)
  return (*vjp(grad), None)


_aqt_ragged_dot.defvjp(_aqt_ragged_dot_fwd, _aqt_ragged_dot_bwd)


# --- Weight-only storage of a frozen base (QLoRA, maxbridge/models/lora.py) --------------
#
# The kernels are stored quantized and dequantized before each forward pass;
# no matmul runs on quantized values. Qwix quantizes (it has the NormalFloat
# codebook of the QLoRA paper as its "nf4" qtype), so nothing here is new math.

WEIGHT_QTYPES = {"int8": jnp.int8, "nf4": "nf4"}
NF4_BLOCK = 64  # the QLoRA paper's block: 64 consecutive inputs of one output channel share an absmax scale


def quantize_weight(kernel: jax.Array, qtype: str, contracted: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(qvalue, scale) of a frozen kernel with `contracted` input axes, by Qwix, absmax calibrated.

  int8: one scale per output channel (int8 values). nf4: 4-bit NormalFloat
  codes (uint4) with one scale per block of up to NF4_BLOCK inputs along the
  last contracted axis (any other contracted axis keeps its own scales), as
  bitsandbytes blocks a row of a [out, in] weight. Every other axis, a
  scanned stack's layer axis included, keeps its own scales: a stack
  quantizes exactly as its layers do one by one.
  """
  if qtype not in WEIGHT_QTYPES:
    raise ValueError(f"weight qtype {qtype!r} is not built; valid values: {', '.join(map(repr, WEIGHT_QTYPES))}")
  channelwise = tuple(i for i in range(kernel.ndim) if i not in contracted)
  tiled = {}
  if qtype == "nf4":
    *others, last = contracted
    channelwise += tuple(others)
    tiled = {last: math.gcd(NF4_BLOCK, kernel.shape[last])}
  quantized = qwix_private.quantize(jnp.asarray(kernel), WEIGHT_QTYPES[qtype], channelwise, tiled_axes=tiled)
  return quantized.qvalue, quantized.scale


def dequantize_weight(qvalue: jax.Array, scale: jax.Array, qtype: str) -> jax.Array:
  """The float kernel (in the scale's dtype) that `quantize_weight`'s (qvalue, scale) stand for."""
  return qwix_private.dequantize(qvalue, scale, WEIGHT_QTYPES[qtype])


# --- Serving: frozen quantized values and scales in place of float kernels -------
#
# A serve model (`checkpoint_is_quantized=true`) declares, for every kernel a
# train-mode model quantizes, `kernel_qvalue` (int8, or Qwix's int4 / e4m3;
# the kernel's shape and axes) and `kernel_scale` (the kernel's shape with 1
# on each contracted axis) in place of `kernel`: the same canonical names on
# both backends, stacked on param_scan_axis like any parameter. Norms,
# embeddings and biases stay float. `models.quantized.serve_tree` computes the
# pair from a float tree with the quantizer train mode runs (AQT's, or Qwix's:
# `quantize_kernel`), and serving feeds it to the same matmul, so serve logits
# are the convert-mode (QAT forward) logits, bit for bit where the matmuls are
# the same ops.

QVALUE, SCALE = "kernel_qvalue", "kernel_scale"
# Routed experts' [E, in, out] weights (`wi_0`, `wo`, ...) serve as `wi_0_qvalue` + `wi_0_scale`: a scale per
# output channel, shared by all experts where the dropless matmul (AQT's and Qwix's `ragged_dot`) shares
# one, else per expert as a dense layer's (`expert_scale_shape`).
QVALUE_SUFFIX, SCALE_SUFFIX = SUFFIXES = ("_qvalue", "_scale")


def qvalue_dtype(config: Config) -> jnp.dtype:
  """The dtype a serve model holds its quantized kernels in: int8 (AQT, Qwix int8), int4, float8_e4m3fn."""
  return jnp.dtype(qwix_rules(config)[0].weight_qtype) if uses_qwix(config) else jnp.dtype(jnp.int8)


def scale_shape(kernel_shape: tuple[int, ...], in_ndim: int) -> tuple[int, ...]:
  """A kernel's per-output-channel scale: 1 on each of its `in_ndim` contracted (leading) axes."""
  return (1,) * in_ndim + tuple(kernel_shape[in_ndim:])


def scale_axes(logical_axes: tuple[str, ...], in_ndim: int) -> tuple[str | None, ...]:
  """Logical axes of a scale: its contracted axes have size 1, so they are never sharded."""
  return (None,) * in_ndim + tuple(logical_axes[in_ndim:])


def _fresh_rhs_quantizer(config: Config):
  # AQT's quantizers hold their calibrator once initialised; a copy keeps the
  # shared (cached) config untouched, and quantizes exactly as its forward pass does.
  quantizer = copy.deepcopy(aqt_dot_general_config(config).fwd.dg_quantizer.rhs)
  quantizer.init_calibration()
  return quantizer


def quantize_kernel(config: Config, kernel: jax.Array, contracted: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(qvalue, scale) of a float kernel, scaled per slice over the `contracted` axes (kept, as size 1).

  Any other axis, a scanned stack's layer axis included, keeps its own scales,
  so a stack quantizes exactly as its layers do one by one. (Qwix's own PTQ
  of a stacked kernel would take the layer axis for a contracted one, sharing
  one scale across layers: hence this function, for Qwix too.)
  """
  kernel = jnp.asarray(kernel).astype(jnp.dtype(config.dtype))  # both quantize the promoted kernel
  if uses_qwix(config):
    rule = qwix_rules(config)[0]
    channelwise = tuple(i for i in range(kernel.ndim) if i not in contracted)
    quantized = qwix_private.quantize(
        kernel, rule.weight_qtype, channelwise, calibration_method=rule.weight_calibration_method
    )
    return quantized.qvalue, quantized.scale
  quantizer = _fresh_rhs_quantizer(config)
  qt = quantizer.calibrate(kernel, calibration_axes=tuple(contracted))
  qt, _ = quantizer.calculate_qvalue(kernel, qt)
  (scale,) = qt.scale
  return qt.qvalue.astype(jnp.int8), scale


def serve_dot_general(config: Config, qvalue: jax.Array, scale: jax.Array) -> linear.DotGeneral:
  """The `dot_general` of a serve-mode dense layer: AQT's int8 matmul with its weight side given, frozen.

  The float operand it is called with (zeros of the kernel's shape, all a
  serve layer has) is never read: AQT takes a complete `QTensor` as is.
  """
  dg = aqt_config.set_context(aqt_dot_general_config(config), key=None, train_step=None)
  frozen = aqt_tensor.QTensor(qvalue=qvalue, scale=[scale], scale_t=None, bias=[], dequant_dtype=scale.dtype)

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type
    return dg.dg_core(lhs, rhs, None, frozen, dimension_numbers)[0]

  return dot_general


def qwix_serve_dot_general(config: Config, qvalue: jax.Array, scale: jax.Array) -> linear.DotGeneral:
  """The `dot_general` of a Qwix PTQ serve layer: what Qwix's `PtqProvider` computes for a quantized weight.

  The activations are quantized on the fly (int8, fp8) with the rule's
  dynamic range; the float operand the layer passes is never read.
  """
  rule = qwix_rules(config)[0]
  weight = qwix_private.frozen(qvalue, scale, rule.weight_qtype)

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del rhs, precision, preferred_element_type
    if rule.act_qtype is not None:
      # "absmax": what Qwix's providers default an unset calibration to.
      calibration = rule.act_calibration_method or "absmax"
      lhs = qwix_private.quantize_lhs(lhs, dimension_numbers, qvalue.ndim, rule.act_qtype, rule.tile_size, calibration)
    return qwix_private.dot_general(lhs, weight, dimension_numbers)

  return dot_general


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrozenExperts:
  """A serve model's routed-expert weight: what the MoE ops take in place of the float [E, in, out] array
  and hand, untouched, to their matmul (`ragged_dot`, `expert_dot_general`)."""

  qvalue: jax.Array
  scale: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.qvalue.shape

  @property
  def ndim(self) -> int:
    return self.qvalue.ndim


def expert_scale_shape(config: Config, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The scale of a served [E, in, out] expert weight: [1, 1, out] for the dropless matmul, else [E, 1, out]."""
  experts, _, out = shape
  return (1, 1, out) if config.sparse_matmul else (experts, 1, out)


def expert_scale_axes(config: Config, logical_axes: tuple[str, ...]) -> tuple[str | None, ...]:
  experts, _, out = logical_axes
  return (None, None, out) if config.sparse_matmul else (experts, None, out)


def _frozen_ragged_dot(config: Config, lhs: jax.Array, rhs: FrozenExperts, group_sizes: jax.Array) -> jax.Array:
  """A served dropless matmul: the activations quantized on the fly as in training, the experts frozen."""
  if uses_qwix(config):
    rule = qwix_rules(config)[0]
    if rule.act_qtype is not None:  # as Qwix's ragged_dot_qt: one scale per row
      lhs = qwix_private.quantize(lhs, rule.act_qtype, [0])
    return qwix_private.ragged_dot(lhs, qwix_private.frozen(rhs.qvalue, rhs.scale, rule.weight_qtype), group_sizes)
  cfg = copy.deepcopy(_aqt_int8(1, False))
  cfg.fwd.dot_general = aqt_ragged_dot.RaggedDot(group_sizes=group_sizes)  # as AQT's ragged_dot sets it
  dg = aqt_config.set_context(cfg, key=None, train_step=None)
  frozen = aqt_tensor.QTensor(qvalue=rhs.qvalue, scale=[rhs.scale], scale_t=None, bias=[], dequant_dtype=lhs.dtype)
  placeholder = jnp.zeros(rhs.shape, lhs.dtype)  # never read: AQT takes the complete QTensor as is
  return dg.dg_core(lhs, placeholder, None, frozen, (([1], [0, 1]), ([], [])))[0]


def expert_dot_general(config: Config, dot_general: linear.DotGeneral) -> linear.DotGeneral:
  """An MoE block's `dot_general`: `dot_general` for float weights (the router's), and serving, the frozen
  matmul of a `FrozenExperts` weight (the dense experts' path, `sparse_matmul=false`)."""
  if not serves_quantized(config):
    return dot_general
  frozen = frozen_dot_general(config)

  def matmul(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    if isinstance(rhs, FrozenExperts):
      return frozen(rhs.qvalue, rhs.scale)(lhs, jnp.zeros(rhs.shape, lhs.dtype), dimension_numbers)
    if uses_qwix(config):  # a float router, quantized on the fly as Qwix's QAT does (no interception serves)
      return frozen(*quantize_kernel(config, rhs, tuple(dimension_numbers[0][1])))(lhs, rhs, dimension_numbers)
    return dot_general(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type)

  return matmul


def is_serve_tree(params: Mapping[str, Any]) -> bool:
  """Whether a canonical tree holds frozen quantized kernels (a serve checkpoint's)."""
  return any(path.endswith("/" + QVALUE) for path in canonical.flatten(params))


def frozen_dot_general(config: Config) -> Callable[[jax.Array, jax.Array], linear.DotGeneral] | None:
  """What a dense layer makes its matmul from when it holds frozen (qvalue, scale), or None: it holds a kernel."""
  if not serves_quantized(config):
    return None
  return functools.partial(qwix_serve_dot_general if uses_qwix(config) else serve_dot_general, config)
