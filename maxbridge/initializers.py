"""Parameter initializers, and the one table that picks them by canonical path.

`mb.create_model` does not use the backends' RNG plumbing: each parameter's key
is derived from the seed and its canonical (unscanned) path, so every flag
combination, scanned or not, starts from the same numbers.
"""

import fnmatch
import zlib
from typing import Callable

import jax
import jax.numpy as jnp

from maxbridge import canonical

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def kernel(in_ndim: int = 1, scale: float = 1.0) -> Initializer:
  """Truncated-normal fan-in scaling over the first `in_ndim` axes (MaxText's nd_dense_init)."""

  def init(key, shape, dtype=jnp.float32):
    axes = tuple(range(len(shape)))
    base = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=axes[:in_ndim], out_axis=axes[in_ndim:]
    )
    return (base(key, shape, jnp.float32) * scale).astype(dtype)

  return init


def query_kernel() -> Initializer:
  """The query kernel carries 1/sqrt(head_dim), so attention never rescales (MaxText)."""

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


# First match wins; patterns are fnmatch globs over unscanned canonical paths.
RULES: tuple[tuple[str, Callable[[], Initializer]], ...] = (
    ("*/embedding", embedding),
    ("*/scale", ones),
    ("*/self_attention/query/kernel", query_kernel),
    ("*/self_attention/out/kernel", lambda: kernel(in_ndim=2)),
    ("*/kernel", kernel),
    ("*/bias", zeros),
    # Routed experts (MaxText's MoeBlock_0 keeps them as bare [E, in, out] params).
    ("*/MoeBlock_0/wi_0", expert_kernel),
    ("*/MoeBlock_0/wi_1", expert_kernel),
    ("*/MoeBlock_0/wo", expert_kernel),
)


def initializer_for(path: str) -> Initializer:
  for pattern, factory in RULES:
    if fnmatch.fnmatchcase(path, pattern):
      return factory()
  raise KeyError(f"no initializer rule matches parameter {path!r}; add one to initializers.RULES")


def key_for(seed: int | jax.Array, path: str) -> jax.Array:
  # crc32 is stable across processes (Python's hash() is salted).
  return jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()))


def init_params(abstract: dict, seed: int | jax.Array, param_scan_axis: int) -> dict:
  """Canonical parameters for the abstract tree; scanned layers are the unscanned ones stacked."""
  scanned = canonical.is_scanned(abstract)
  per_layer = canonical.unstack_layers(abstract, param_scan_axis) if scanned else abstract
  flat = {
      path: initializer_for(path)(key_for(seed, path), leaf.shape, leaf.dtype)
      for path, leaf in canonical.flatten(per_layer).items()
  }
  tree = canonical.unflatten(flat)
  return canonical.stack_layers(tree, param_scan_axis) if scanned else tree
