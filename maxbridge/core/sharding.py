"""Device mesh and logical axis rules: the one place logical names meet mesh axes.

Parameters carry logical axis names (`embed`, `mlp`, `layers`, ...) in both
backends; activations are constrained by logical names inside `maxbridge.ops`.
`logical_axis_rules` in the config maps each name to mesh axes, MaxText style.
"""

import collections
import contextlib
import contextvars
import math
import os
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxbridge.core import config_rules
from maxbridge.core.config import MESH_AXES, Config, ConfigError

_PARALLELISM_KEYS = config_rules.ICI_PARALLELISM_KEYS

# (mesh, rules) while a step is traced; ops read it through `constrain`.
_ACTIVE: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar("maxbridge_sharding", default=None)
_WARNED: set[str] = set()


# The mesh axes a multi-process (multi-slice) run may also split over processes: MaxText's dcn_* keys.
_DCN_KEYS = {
    "diloco": "dcn_diloco_parallelism",
    "data": "dcn_data_parallelism",
    "stage": "dcn_pipeline_parallelism",
    "fsdp": "dcn_fsdp_parallelism",
}


def _fill(sizes: dict[str, int], total: int, what: str) -> tuple[int, ...]:
  """Config sizes by key (one may be -1: what remains) -> the sizes, whose product must be `total` `what`."""
  unknown = [key for key, size in sizes.items() if size == -1]
  if len(unknown) > 1:
    raise ConfigError(f"only one of {', '.join(sizes)} may be -1; got -1 for {unknown}")
  known = math.prod(size for size in sizes.values() if size != -1)
  if unknown:
    if total % known:
      raise ConfigError(
          f"{unknown[0]}=-1 cannot fill {total} {what}: the other axes use {known}, which does not divide {total}"
      )
    sizes = {**sizes, unknown[0]: total // known}
  if math.prod(sizes.values()) != total:
    described = ", ".join(f"{k}={s}" for k, s in sizes.items())
    raise ConfigError(
        f"the mesh {described} needs {math.prod(sizes.values())} {what}, but {total} are "
        "available; make the product equal the count (or set one axis to -1)"
    )
  return tuple(sizes.values())


def dcn_shape(config: Config, num_processes: int | None = None) -> tuple[int, ...]:
  """How many processes each of MESH_AXES spans (1 where it stays inside a process).

  `num_processes` None: as many as the dcn_* keys name (an abstract mesh), their -1 read as 1.
  """
  sizes = {key: getattr(config, key) for key in _DCN_KEYS.values()}
  if all(size == 1 for size in sizes.values()):
    return (1,) * len(MESH_AXES)  # one mesh over every device of every process, as before any dcn key was set
  if num_processes is None:
    num_processes = math.prod(size for size in sizes.values() if size != -1)
  if num_processes == 1 and any(size > 1 for size in sizes.values()):
    named = ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1)
    raise ConfigError(
        f"{named} split the mesh over processes, but this run has one process: set num_processes (with "
        "coordinator_address and process_id) or leave the dcn_* keys at 1"
    )
  filled = dict(zip(_DCN_KEYS, _fill(sizes, num_processes, "processes")))
  return tuple(filled.get(axis, 1) for axis in MESH_AXES)


def mesh_shape(config: Config, num_devices: int, num_processes: int | None = None) -> tuple[int, ...]:
  """The sizes of MESH_AXES (diloco, data, stage, fsdp, context, tensor, expert) over `num_devices` devices.

  The ici_* keys (one may be -1: the remaining devices) split each process's
  devices, the dcn_* keys the processes (see `dcn_shape`); an axis's size is the product.
  """
  dcn = dcn_shape(config, num_processes)
  if num_devices % math.prod(dcn):
    raise ConfigError(f"{num_devices} devices do not divide over {math.prod(dcn)} processes (the dcn_* keys)")
  what = "devices" if math.prod(dcn) == 1 else "devices per process"
  ici = _fill({key: getattr(config, key) for key in _PARALLELISM_KEYS}, num_devices // math.prod(dcn), what)
  return tuple(i * d for i, d in zip(ici, dcn))


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
  """The run's mesh over `devices` (default: every device of every process).

  With dcn_* keys above 1, a hybrid mesh (MaxText's multi-slice one, processes
  standing in for slices): the axes a dcn key names span processes, the
  others stay inside each process, whose devices are one ici mesh.
  """
  devices = jax.devices() if devices is None else list(devices)
  by_process = collections.Counter(device.process_index for device in devices)
  shape = mesh_shape(config, len(devices), len(by_process))
  dcn = dcn_shape(config, len(by_process))
  if math.prod(dcn) == 1:
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)
  if len(set(by_process.values())) > 1:
    raise ConfigError(
        f"the dcn_* keys split the mesh over processes, which must hold as many devices each: {dict(by_process)}"
    )
  ici = tuple(size // d for size, d in zip(shape, dcn))
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
  return Mesh(grid, MESH_AXES)


def logical_to_spec(logical_axes: Sequence[str | None], rules: tuple) -> PartitionSpec:
  """Logical names -> PartitionSpec; a name missing from the rules is replicated (warned once)."""
  known = {name for name, _ in rules}
  for name in logical_axes:
    if isinstance(name, str) and name not in known and name not in _WARNED:
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


def current() -> tuple[Mesh, tuple] | None:
  """The (mesh, rules) of `active` while a step is traced, None outside: for ops that place their own shards
  (`ops.splash_attention`'s shard_map)."""
  return _ACTIVE.get()


def axis_size(axis: str) -> int:
  """The size of mesh axis `axis` while a step is traced (see `active`); 1 outside."""
  current = _ACTIVE.get()
  return 1 if current is None else current[0].shape[axis]


def platform() -> str:
  """The platform a step is compiled for: the active mesh's devices' ("tpu" when compiling for a TPU topology
  from a CPU host, see `training.topology`), else JAX's default backend."""
  current = _ACTIVE.get()
  return jax.default_backend() if current is None else current[0].devices.flat[0].platform


def constrain(x: jax.Array, logical_axes: Sequence[Any]) -> jax.Array:
  """Constrains an activation by logical names; a no-op outside `active` (plain inference).

  A `PartitionSpec.UNCONSTRAINED` entry leaves that dimension to the partitioner.
  """
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


def with_data_axis(where: NamedSharding, shape: Any) -> NamedSharding:
  """ZeRO-1: `where` also split over "data", on the first dimension that divides (MaxText's choice: one
  not split over "tensor"); kept as it is when "data" is already there or no dimension divides."""
  data = where.mesh.shape["data"]
  spec = (*where.spec, *(None,) * (len(shape.shape) - len(where.spec)))
  if data == 1 or "data" in jax.tree.leaves(tuple(spec)):
    return where
  for dim, (size, axes) in enumerate(zip(shape.shape, spec)):
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    parts = math.prod(where.mesh.shape[a] for a in axes)
    if "tensor" not in axes and size % (parts * data) == 0:
      split = ("data", *axes) if axes else "data"
      return NamedSharding(where.mesh, PartitionSpec(*spec[:dim], split, *spec[dim + 1 :]))
  return where


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
