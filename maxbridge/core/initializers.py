"""Parameter initializers, and the one table that picks them by canonical path.

`mb.create_model` does not use the backends' RNG plumbing: each parameter's key
is derived from the seed and its canonical (unscanned) path, so every flag
combination, scanned or not, starts from the same numbers. Modules never pick
initial values: they hold a `placeholder` until `init_params` writes `rules`'.
"""

import dataclasses
import fnmatch
import functools
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import canonical
from maxbridge.core.families import query_kernel_carries_scale  # re-exported: the attention layers ask here

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


@dataclasses.dataclass(frozen=True)
class InitOptions:
  """What initial values depend on besides the parameter tree.

  Hashable and small, so that one compiled initialiser serves every config
  that shares them (every flag combination of one model).
  """

  param_scan_axis: int
  query_kernel_carries_scale: bool
  # The family's norms hold w of the multiplier 1 + w (`Family.norm` "zero_centred_rms_norm"): their scales start at 0.
  zero_centred_norms: bool = False

  @classmethod
  def from_config(cls, config) -> "InitOptions":
    zero_centred = config.normalization == "zero_centred_rms_norm"
    return cls(config.param_scan_axis, query_kernel_carries_scale(config), zero_centred)


def placeholder(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """What a module holds for a parameter when built, before `init_params` writes the real value.

  Modules are built under `eval_shape` or `jit` (`create_model`, the trainers),
  where this costs nothing. Zeros, so that parameters never written stand out.
  """
  del key
  return jnp.zeros(shape, dtype)


def kernel(in_ndim: int = 1, scale: float = 1.0) -> Initializer:
  """Truncated-normal fan-in scaling over the first `in_ndim` axes (MaxText's nd_dense_init)."""

  def init(key, shape, dtype=jnp.float32):
    axes = tuple(range(len(shape)))
    base = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=axes[:in_ndim], out_axis=axes[in_ndim:]
    )
    return (base(key, shape, jnp.float32) * scale).astype(dtype)

  return init


def query_kernel(carries_scale: bool) -> Initializer:
  """A fan-in kernel, times 1/sqrt(head_dim) (its last axis) when it carries attention's scale."""
  if not carries_scale:
    return kernel()

  def init(key, shape, dtype=jnp.float32):
    return kernel(in_ndim=1, scale=shape[-1] ** -0.5)(key, shape, dtype)

  return init


def embedding() -> Initializer:
  return lambda key, shape, dtype=jnp.float32: jax.random.normal(key, shape, dtype)


def ones() -> Initializer:
  return lambda key, shape, dtype=jnp.float32: jnp.ones(shape, dtype)


def zeros() -> Initializer:
  return lambda key, shape, dtype=jnp.float32: jnp.zeros(shape, dtype)


def expert_kernel() -> Initializer:
  """[experts, in, out]: fan-in scaling over `in`, each expert drawn independently."""

  def init(key, shape, dtype=jnp.float32):
    base = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=0)
    return base(key, shape, jnp.float32).astype(dtype)

  return init


def lora_a() -> Initializer:
  """A LoRA adapter's A [*in, rank]: fan-in scaling over its input axes (B starts at zero)."""
  return lambda key, shape, dtype=jnp.float32: kernel(in_ndim=len(shape) - 1)(key, shape, dtype)


def rules(options: InitOptions) -> tuple[tuple[str, Initializer], ...]:
  """The table: first match wins; patterns are fnmatch globs over unscanned canonical paths."""
  return (
      ("*/embedding", embedding()),
      # Qwen3-Next's DeltaNet gated norm holds its multiplier itself, unlike the family's other (zero-centred) norms.
      ("*/linear_attention/norm/scale", ones()),
      ("*/scale", zeros() if options.zero_centred_norms else ones()),
      ("*/layer_scalar", ones()),  # Gemma 4's per-layer output scalar
      ("*/gate/per_expert_scale", ones()),  # Gemma 4's router
      # Also MLA's query kernel (q_lora_rank=0), which never carries the scale.
      ("*/self_attention/query/kernel", query_kernel(options.query_kernel_carries_scale)),
      ("*/self_attention/out/kernel", kernel(in_ndim=2)),
      # A block's suffixed sub-layers (Gemma 2's, as MaxText names them: self_attention_local).
      ("*/self_attention_*/query/kernel", query_kernel(options.query_kernel_carries_scale)),
      ("*/self_attention_*/out/kernel", kernel(in_ndim=2)),
      ("*/kernel", kernel()),
      ("*/kernel_lora_a", lora_a()),
      ("*/kernel_lora_b", zeros()),
      ("*/bias", zeros()),
      # gpt-oss: attention sinks, and its experts' fused gate/up kernel and their biases.
      ("*/self_attention/sinks", zeros()),
      ("*/MoeBlock_0/wi", expert_kernel()),
      ("*/MoeBlock_0/*_bias", zeros()),
      # Routed experts (MaxText's MoeBlock_0, and Qwen3-MoE's moe_block, keep them as bare [E, in, out] params).
      ("*/MoeBlock_0/wi_0", expert_kernel()),
      ("*/MoeBlock_0/wi_1", expert_kernel()),
      ("*/MoeBlock_0/wo", expert_kernel()),
      ("*/moe_block/wi_0", expert_kernel()),
      ("*/moe_block/wi_1", expert_kernel()),
      ("*/moe_block/wo", expert_kernel()),
      # Qwen3-Next's gated DeltaNet: decay rate exp(A_log) = 1, and transformers' time-step bias of ones.
      ("*/linear_attention/A_log", zeros()),
      ("*/linear_attention/dt_bias", ones()),
  )


def rule_index(path: str, options: InitOptions) -> int:
  """The index in `rules(options)` of the first pattern `path` (unscanned) matches."""
  for index, (pattern, _) in enumerate(rules(options)):
    if fnmatch.fnmatchcase(path, pattern):
      return index
  raise KeyError(f"no initializer rule matches parameter {path!r}; add one to initializers.rules")


def initializer_for(path: str, options: InitOptions) -> Initializer:
  return rules(options)[rule_index(path, options)][1]


def key_for(seed: int | jax.Array, path: str) -> jax.Array:
  return jax.random.fold_in(jax.random.key(seed), _salt(path))


def _salt(path: str) -> int:
  return zlib.crc32(path.encode())  # stable across processes (Python's hash() is salted)


def init_params(abstract: dict, seed: int | jax.Array, options: InitOptions) -> dict:
  """Canonical parameters for the abstract tree, traceable; scanned layers are the unscanned ones stacked."""
  axis = options.param_scan_axis
  scanned = canonical.is_scanned(abstract)
  per_layer = canonical.unstack_layers(abstract, axis) if scanned else abstract
  flat = {
      path: initializer_for(path, options)(key_for(seed, path), leaf.shape, leaf.dtype)
      for path, leaf in canonical.flatten(per_layer).items()
  }
  tree = canonical.unflatten(flat)
  return canonical.stack_layers(tree, axis) if scanned else tree


def jitted_init(spec: tuple, options: InitOptions, shardings: tuple | None = None) -> Callable:
  """`init_params`' values for one tree (`spec`: (path, shape, dtype name) per leaf), compiled a draw at a time, into
  `shardings` (one per leaf; None: the default device).

  Not one program for the tree: XLA's compile time grows with the number of leaves drawn (27 s for gemma4-tiny's
  190 on a CPU, most of its start-up), while a leaf's draw is one small program per initializer, shape and
  sharding, shared by every layer and model that has them. The values are bit-identical to `init_params` traced
  whole (tests/test_families.py). A scanned leaf is drawn a layer at a time, each layer in the stack's sharding less its
  layer axis, then stacked: at most twice one leaf's bytes, never a whole leaf on one device.
  """
  axis = options.param_scan_axis

  def init(seed) -> dict:
    flat = {}
    for index, (path, shape, dtype) in enumerate(spec):
      sharding = None if shardings is None else shardings[index]
      if not canonical.is_stacked(path):
        flat[path] = _draw(path, shape, dtype, options, sharding, seed)
        continue
      layer_shape = shape[:axis] + shape[axis + 1 :]
      layer_sharding = None if sharding is None else _without_axis(sharding, axis, len(shape))
      layers = [
          _draw(canonical.layer_path(path, layer), layer_shape, dtype, options, layer_sharding, seed)
          for layer in range(shape[axis])
      ]
      flat[path] = _stacking(len(layers), axis, sharding)(*layers)
    return canonical.unflatten(flat)

  return init


def _draw(path: str, shape: tuple, dtype: str, options: InitOptions, sharding, seed) -> jax.Array:
  return _drawing(rule_index(path, options), shape, dtype, options, sharding)(seed, np.uint32(_salt(path)))


@functools.lru_cache(maxsize=None)
def _drawing(rule: int, shape: tuple, dtype: str, options: InitOptions, sharding) -> Callable:
  initializer = rules(options)[rule][1]

  def draw(seed, salt):
    return initializer(jax.random.fold_in(jax.random.key(seed), salt), shape, jnp.dtype(dtype))

  return jax.jit(draw, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _stacking(count: int, axis: int, sharding) -> Callable:
  return jax.jit(lambda *layers: jnp.stack(layers, axis=axis), out_shardings=sharding)


def _without_axis(sharding: jax.sharding.NamedSharding, axis: int, ndim: int) -> jax.sharding.NamedSharding:
  spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:axis], *spec[axis + 1 :]))
