"""Look before you allocate: the sharding table and an ahead-of-time compiled train step.

Both work on abstract state (shapes, dtypes, shardings), so a 7B model's
plan is inspected on a laptop: on CPU, virtual devices stand in for a mesh
(`--xla_force_host_platform_device_count`).
"""

import math

import jax
import numpy as np

from maxbridge.core import canonical, sharding
from maxbridge.core.config import Config
from maxbridge.training import distill, recipe


def _rows_of(tree) -> dict[str, object]:
  return canonical.flatten(tree["params"]["params"])


def sharding_rows(config: Config) -> list[dict]:
  """One row per parameter: canonical path, shape, logical axes, PartitionSpec, bytes per device."""
  trainer = recipe.create_trainer(config)
  layout = _rows_of(trainer.disk_layout)
  logical = _rows_of(trainer.to_checkpoint(trainer.logical_specs()))
  placed = _rows_of(trainer.to_checkpoint(trainer.state_shardings))
  return [
      {
          "path": path,
          "shape": tuple(leaf.shape),
          "logical_axes": tuple(logical[path]),
          "spec": placed[path].spec,
          "bytes_per_device": _bytes_on_one_device(leaf, placed[path]),
      }
      for path, leaf in layout.items()
  ]


def _bytes_on_one_device(leaf, where) -> int:
  return math.prod(where.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def _state_bytes_per_device(trainer) -> int:
  """Parameters + optimizer state + step, as laid out on the mesh, per device."""
  placed = jax.tree.leaves(trainer.to_checkpoint(trainer.state_shardings))
  return sum(map(_bytes_on_one_device, jax.tree.leaves(trainer.disk_layout), placed))


def format_table(rows: list[dict], mesh_shape: tuple[int, ...]) -> str:
  header = ("path", "shape", "logical axes", "PartitionSpec", "MiB/device")
  lines = [
      (
          r["path"],
          str(r["shape"]),
          ", ".join(str(a) for a in r["logical_axes"]),
          str(r["spec"]),
          f"{r['bytes_per_device'] / 2**20:.2f}",
      )
      for r in rows
  ]
  widths = [max(len(x) for x in column) for column in zip(header, *lines)]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  total = sum(r["bytes_per_device"] for r in rows) / 2**20
  mesh = " x ".join(f"{name}={size}" for name, size in zip(sharding.MESH_AXES, mesh_shape))
  return "\n".join(
      [
          f"mesh: {mesh}",
          fmt.format(*header),
          *(fmt.format(*line) for line in lines),
          f"parameters: {total:.2f} MiB per device",
      ]
  )


def model_flops(config: Config, num_params: int, tokens: int) -> float:
  """Training FLOPs for `tokens` tokens: 6*N*tokens + 12*L*T*H*tokens, the standard estimate.

  N all parameters, L layers, T sequence length, H query heads * head dim:
  forward and backward matmuls of the weights, plus the attention scores and
  their weighted sum over the full T x T (no causal skipping is compiled).
  """
  attention_width = config.num_query_heads * config.head_dim
  return (6 * num_params + 12 * config.num_decoder_layers * config.max_target_length * attention_width) * tokens


def compile_train_step(config: Config) -> dict:
  """Lowers and compiles the train step on abstract, sharded inputs; returns its costs."""
  trainer = recipe.create_trainer(config)
  sharding.check_divisible(trainer.abstract_state(), trainer.state_shardings)
  state = jax.tree.map(
      lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
      trainer.abstract_state(),
      trainer.state_shardings,
  )
  rows = config.per_device_batch_size * jax.device_count() * config.gradient_accumulation_steps
  shapes = {key: jax.ShapeDtypeStruct((rows, config.max_target_length), np.int32) for key in trainer.loss.batch_keys}
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
      "devices": jax.device_count(),
      "mesh": dict(zip(sharding.MESH_AXES, trainer.mesh.devices.shape)),
      "argument_bytes": memory.argument_size_in_bytes,
      "output_bytes": memory.output_size_in_bytes,
      "temp_bytes": memory.temp_size_in_bytes,
      "alias_bytes": memory.alias_size_in_bytes,
      "state_bytes": _state_bytes_per_device(trainer),
      "flops": float(cost.get("flops", float("nan"))) if cost else float("nan"),
  }
