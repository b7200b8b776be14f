"""Device mesh and logical axis rules: the one place logical names meet mesh axes.

Parameters carry logical axis names (`embed`, `mlp`, `layers`, ...) in both
backends; activations are constrained by logical names inside `maxbridge.ops`.
`logical_axis_rules` in the config maps each name to mesh axes, MaxText style.
"""

import contextlib
import contextvars
import math
import os
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxbridge.core.config import MESH_AXES, Config, ConfigError

# In MESH_AXES's order.
_PARALLELISM_KEYS = (
    "ici_data_parallelism",
    "ici_pipeline_parallelism",
    "ici_fsdp_parallelism",
    "ici_context_parallelism",
    "ici_tensor_parallelism",
    "ici_expert_parallelism",
)

# (mesh, rules) while a step is traced; ops read it through `constrain`.
_ACTIVE: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar("maxbridge_sharding", default=None)
_WARNED: set[str] = set()


def mesh_shape(config: Config, num_devices: int) -> tuple[int, ...]:
  """The sizes of MESH_AXES (data, stage, fsdp, context, tensor, expert); one of them may be -1, meaning the remaining devices."""
  sizes = [getattr(config, key) for key in _PARALLELISM_KEYS]
  unknown = [key for key, size in zip(_PARALLELISM_KEYS, sizes) if size == -1]
  if len(unknown) > 1:
    raise ConfigError(f"only one of {', '.join(_PARALLELISM_KEYS)} may be -1; got -1 for {unknown}")
  known = math.prod(size for size in sizes if size != -1)
  if unknown:
    if num_devices % known:
      raise ConfigError(
          f"{unknown[0]}=-1 cannot fill {num_devices} devices: the other axes use {known}, "
          f"which does not divide {num_devices}"
      )
    sizes[_PARALLELISM_KEYS.index(unknown[0])] = num_devices // known
  if math.prod(sizes) != num_devices:
    described = ", ".join(f"{k}={s}" for k, s in zip(_PARALLELISM_KEYS, sizes))
    raise ConfigError(
        f"the mesh {described} needs {math.prod(sizes)} devices, but {num_devices} are "
        "available; make the product equal the device count (or set one axis to -1)"
    )
  return tuple(sizes)


def initialize_distributed(config: Config) -> None:
  """Joins a multi-process run (jax.distributed) when the config or JAX_* variables ask for one.

  Must run before JAX touches a device. On CPU, collectives across processes
  go through gloo.
  """
  if config.num_processes > 1:
    num_processes, process_id = config.num_processes, config.process_id
  else:
    num_processes = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    process_id = int(os.environ.get("JAX_PROCESS_ID", "0"))
  if num_processes <= 1 or jax.distributed.is_initialized():
    return
  address = config.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address:
    raise ConfigError(
        f"num_processes={num_processes} needs coordinator_address=host:port "
        "(or JAX_COORDINATOR_ADDRESS) naming process 0"
    )
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(address, num_processes, process_id)


def create_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(config, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_spec(logical_axes: Sequence[str | None], rules: tuple) -> PartitionSpec:
  """Logical names -> PartitionSpec; a name missing from the rules is replicated (warned once)."""
  known = {name for name, _ in rules}
  for name in logical_axes:
    if name is not None and name not in known and name not in _WARNED:
      _WARNED.add(name)
      logging.warning("logical axis %r has no rule in logical_axis_rules; it is replicated", name)
  return nn.logical_to_mesh_axes(tuple(logical_axes), rules)


def named_sharding(mesh: Mesh, logical_axes: Sequence[str | None], rules: tuple) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes, rules))


@contextlib.contextmanager
def active(mesh: Mesh, rules: tuple) -> Iterator[None]:
  """Turns on activation constraints (see `constrain`) while a step is traced."""
  token = _ACTIVE.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Constrains an activation by logical names; a no-op outside `active` (plain inference)."""
  current = _ACTIVE.get()
  if current is None:
    return x
  mesh, rules = current
  return jax.lax.with_sharding_constraint(x, named_sharding(mesh, logical_axes, rules))


def spec_tree_to_shardings(specs: Any, mesh: Mesh, rules: tuple) -> Any:
  """A tree of logical PartitionSpecs (leaves) -> the same tree of NamedShardings."""
  return jax.tree.map(
      lambda spec: named_sharding(mesh, tuple(spec), rules),
      specs,
      is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def check_divisible(shapes: Any, shardings: Any) -> None:
  """Every array divides evenly over the mesh axes its sharding splits it on; else a ConfigError naming it.

  `shapes` and `shardings` are trees of one structure (leaves with `.shape`,
  and NamedShardings), e.g. a trainer's abstract state and its state shardings.
  JAX's own error names the shape, not the parameter.
  """

  def check(path, leaf, where):
    for dim, (size, axes) in enumerate(zip(leaf.shape, where.spec)):
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      parts = math.prod(where.mesh.shape[a] for a in axes)
      if size % parts:
        name = jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")  # NNX Variables
        split = " x ".join(f"{a}={where.mesh.shape[a]}" for a in axes)
        raise ConfigError(
            f"{name} {tuple(leaf.shape)}: dimension {dim} ({size}) does not divide over the mesh axes "
            f"{split} ({parts} parts); change the ici_*_parallelism sizes or logical_axis_rules"
        )

  jax.tree_util.tree_map_with_path(check, shapes, shardings)
