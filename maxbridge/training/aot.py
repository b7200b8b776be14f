"""Look before you allocate: the sharding table and an ahead-of-time compiled train step.

Both work on abstract state (shapes, dtypes, shardings), so a 70B model's
plan is inspected on a laptop. The table needs no devices at all (an
`AbstractMesh`); the compile does: on CPU, virtual devices stand in for a mesh
(`--xla_force_host_platform_device_count`).
"""

import math

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from maxbridge.core import canonical, sharding
from maxbridge.core.config import Config
from maxbridge.training import distill, recipe, topology

# The groups of a train state's arrays, in the order the table lists them.
GROUPS = ("parameters", "optimizer state", "step", "replicas")


def abstract_mesh(config: Config, num_devices: int) -> AbstractMesh:
  """The config's mesh over `num_devices` devices, as shapes only: no device needs to exist."""
  return AbstractMesh(sharding.mesh_shape(config, num_devices), sharding.MESH_AXES)


def _flat(tree) -> dict[str, object]:
  """{"a/b/0/c": leaf}; a PartitionSpec is a leaf, and None (an empty optax state) is no leaf."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
  return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in leaves}


def sharding_rows(config: Config, mesh: Mesh | AbstractMesh | None = None) -> list[dict]:
  """One row per array of the train state, in the checkpoint's layout (the same on both backends).

  Each row: `path` (a parameter's canonical path; "opt_state/..." and "step" as
  in the checkpoint), `group` ("parameters", "optimizer state" or "step"),
  shape, dtype, logical axes, PartitionSpec and bytes per device. `mesh`
  defaults to the config's over all devices; an `abstract_mesh` needs none.
  An array that does not divide over its mesh axes is a ConfigError naming it.
  """
  trainer = recipe.create_trainer(config, mesh)
  layout_tree, placed_tree = trainer.disk_layout, trainer.to_checkpoint(trainer.state_shardings)
  # JAX's own error names a shape, not the array: check first, the parameters before their optimizer state.
  sharding.check_divisible(layout_tree["params"], placed_tree["params"])
  sharding.check_divisible(layout_tree, placed_tree)
  layout, placed = _flat(layout_tree), _flat(placed_tree)
  logical = _flat(trainer.to_checkpoint(trainer.logical_specs()))
  trained = f"params/{trainer.trainable.collection}/"
  rows = []
  for path, leaf in layout.items():
    if path.startswith(trained):
      group = "parameters"
    elif path.startswith("diloco/"):  # DiLoCo's replicas: their parameters and inner optimizer states
      group = "replicas"
    else:
      group = "step" if path == "step" else "optimizer state"
    rows.append(
        {
            "path": path.removeprefix(trained),
            "group": group,
            "shape": tuple(leaf.shape),
            "dtype": str(leaf.dtype),
            "logical_axes": tuple(logical[path]),
            "spec": placed[path].spec,
            "bytes_per_device": _bytes_on_one_device(leaf, placed[path]),
        }
    )
  return sorted(rows, key=lambda row: GROUPS.index(row["group"]))  # stable: each group in the checkpoint's order


def _bytes_on_one_device(leaf, where) -> int:
  return math.prod(where.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def _state_bytes_per_device(trainer) -> int:
  """Parameters + optimizer state + step, as laid out on the mesh, per device."""
  placed = jax.tree.leaves(trainer.to_checkpoint(trainer.state_shardings))
  return sum(map(_bytes_on_one_device, jax.tree.leaves(trainer.disk_layout), placed))


def format_table(rows: list[dict], mesh: Mesh | AbstractMesh) -> str:
  """`rows` (`sharding_rows`) as `maxbridge shardings` prints them: exact bytes, so a changed plan shows in a diff."""
  header = ("path", "shape", "dtype", "logical axes", "PartitionSpec", "bytes/device")
  lines = [
      (
          r["path"],
          str(r["shape"]),
          r["dtype"],
          ", ".join(str(a) for a in r["logical_axes"]),
          str(r["spec"]),
          f"{r['bytes_per_device']:,}",
      )
      for r in rows
  ]
  widths = [max(len(x) for x in column) for column in zip(header, *lines)]
  # Left-aligned text, right-aligned bytes; no trailing spaces, so a golden file diffs cleanly.
  fmt = "  ".join([*(f"{{:<{w}}}" for w in widths[:-1]), f"{{:>{widths[-1]}}}"])
  totals = {group: sum(r["bytes_per_device"] for r in rows if r["group"] == group) for group in GROUPS}
  if not totals["replicas"]:  # only a DiLoCo run has them
    del totals["replicas"]
  everything = sum(totals.values())
  described = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
  return "\n".join(
      [
          f"mesh: {described}",
          fmt.format(*header),
          *(fmt.format(*line) for line in lines),
          *(f"{group}: {size:,} bytes ({size / 2**20:.2f} MiB) per device" for group, size in totals.items()),
          f"total: {everything:,} bytes ({everything / 2**20:.2f} MiB) per device",
      ]
  )


def sharding_table(config: Config, num_devices: int) -> str:
  """What `maxbridge shardings --devices N` prints: the plan of the config's mesh over N devices, none needed."""
  mesh = abstract_mesh(config, num_devices)
  return format_table(sharding_rows(config, mesh), mesh)


def model_flops(config: Config, num_params: int, tokens: int) -> float:
  """Training FLOPs for `tokens` tokens: 6*N*tokens + 12*L*T*H*tokens, the standard estimate.

  N all parameters, L layers, T sequence length, H query heads * head dim:
  forward and backward matmuls of the weights, plus the attention scores and
  their weighted sum over the full T x T (no causal skipping is compiled).
  """
  attention_width = config.num_query_heads * config.head_dim
  return (6 * num_params + 12 * config.num_decoder_layers * config.max_target_length * attention_width) * tokens


def compile_train_step(config: Config) -> dict:
  """Lowers and compiles the train step on abstract, sharded inputs; returns its costs per device.

  Over this host's devices, or with `compile_topology` over a TPU slice's
  (`training.topology`). A step too big for the slice's HBM raises the TPU
  compiler's error (`topology.out_of_memory` reads it).
  """
  mesh = None
  if config.compile_topology:
    mesh = sharding.create_mesh(config, topology.devices(topology.target(config)))
  trainer = recipe.create_trainer(config, mesh)
  sharding.check_divisible(trainer.abstract_state(), trainer.state_shardings)
  state = jax.tree.map(
      lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
      trainer.abstract_state(),
      trainer.state_shardings,
  )
  rows = config.per_device_batch_size * trainer.mesh.size * config.gradient_accumulation_steps
  shapes = trainer.loss.abstract_batch(rows, config.max_target_length)
  if config.distill_logits_path:  # the teacher's top-k logits come with each batch
    shapes.update(distill.offline_shapes(config, rows))
  batch = {
      key: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=trainer.batch_sharding)
      for key, shape in shapes.items()
  }
  compiled = trainer.lower_train_step(state, batch).compile()
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  tokens = rows * config.max_target_length
  num_params = sum(math.prod(leaf.shape) for leaf in canonical.flatten(trainer.abstract_params).values())
  return {
      "model_flops": model_flops(config, num_params, tokens),
      "devices": trainer.mesh.size,
      "device_kind": trainer.mesh.devices.flat[0].device_kind,
      "mesh": dict(zip(sharding.MESH_AXES, trainer.mesh.devices.shape)),
      "argument_bytes": memory.argument_size_in_bytes,
      "output_bytes": memory.output_size_in_bytes,
      "temp_bytes": memory.temp_size_in_bytes,
      "alias_bytes": memory.alias_size_in_bytes,
      "peak_bytes": memory.peak_memory_in_bytes,
      "host_bytes": memory.host_argument_size_in_bytes + memory.host_temp_size_in_bytes,
      "state_bytes": _state_bytes_per_device(trainer),
      "flops": float(cost.get("flops", float("nan"))) if cost else float("nan"),
      "bytes_accessed": float(cost.get("bytes accessed", float("nan"))) if cost else float("nan"),
  }
