"""A TPU slice this host does not have, for `maxbridge compile compile_topology=v5p-8` (MaxText's train_compile).

With libtpu installed (`maxbridge[tpu]`), `jax.experimental.topologies` describes
the chips of a slice, and the train step lowered over a mesh of those abstract
devices is compiled by the real TPU compiler, on any host: its memory per chip and
its costs are the ones the slice would see, and a step that does not fit fails here
with the compiler's own out-of-memory message, before any chip is rented.
"""

import dataclasses
import importlib.util
import math
import re

import jax

from maxbridge.core.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation: how its slices are named and laid out, and what one chip holds and does."""

  dims: int  # 3: a 3-D torus (v4, v5p); 2: a 2-D one (v5e, v6e)
  cores_per_chip: int  # what the number in a slice's name counts per chip: v4-8 and v5p-8 are 4 chips
  hbm_gib: float
  bf16_tflops: float  # peak dense bf16 matmul throughput
  hbm_gbps: float  # HBM bandwidth, GB/s


# Google's published figures per chip.
CHIPS = {
    "v4": Chip(dims=3, cores_per_chip=2, hbm_gib=32, bf16_tflops=275, hbm_gbps=1228),
    "v5e": Chip(dims=2, cores_per_chip=1, hbm_gib=16, bf16_tflops=197, hbm_gbps=819),
    "v5p": Chip(dims=3, cores_per_chip=2, hbm_gib=95, bf16_tflops=459, hbm_gbps=2765),
    "v6e": Chip(dims=2, cores_per_chip=1, hbm_gib=32, bf16_tflops=918, hbm_gbps=1640),
}
_NAME = re.compile(r"(v4|v5e|v5p|v6e)-(\d+)")


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # as the user wrote it: v5p-8
  chip_name: str  # v5p
  chip: Chip
  shape: tuple[int, ...]  # chips along each torus axis, per slice
  num_slices: int

  @property
  def chips(self) -> int:
    return math.prod(self.shape) * self.num_slices


def _torus(chips: int, dims: int) -> tuple[int, ...]:
  """The slice shape Google provisions for `chips` chips: v5e-8 is 2x4, v5p-8 (4 chips) 2x2x1, v5p-128 4x4x4.

  Grown from the smallest slice by doubling its shortest axis (the later one on a tie).
  """
  shape = [1, 1] if dims == 2 else [2, 2, 1]
  while math.prod(shape) < chips:
    shortest = min(shape)
    axis = max(i for i, size in enumerate(shape) if size == shortest)
    shape[axis] *= 2
  return tuple(shape)


def target(config: Config) -> Target:
  """The config's `compile_topology` (MaxText's slice names: v4-N, v5e-N, v5p-N, v6e-N) as a slice shape."""
  name = config.compile_topology
  match = _NAME.fullmatch(name)
  valid = "v4-N or v5p-N (N TensorCores, 2 per chip, N >= 8) or v5e-N or v6e-N (N chips), N a power of two"
  if not match:
    raise ConfigError(f"compile_topology={name!r} names no TPU slice: {valid}")
  chip_name, count = match.group(1), int(match.group(2))
  chip = CHIPS[chip_name]
  chips = count // chip.cores_per_chip
  smallest = 4 if chip.dims == 3 else 1
  if count % chip.cores_per_chip or chips < smallest or chips & (chips - 1):
    raise ConfigError(f"compile_topology={name!r} names no TPU slice: {valid}")
  if config.compile_topology_num_slices < 1:
    raise ConfigError(f"compile_topology_num_slices={config.compile_topology_num_slices} must be at least 1")
  return Target(name, chip_name, chip, _torus(chips, chip.dims), config.compile_topology_num_slices)


def devices(spec: Target) -> list[jax.Device]:
  """The slice's chips as abstract TPU devices (one process per slice, as on real multi-slice hardware)."""
  if importlib.util.find_spec("libtpu") is None:
    raise ConfigError(f"compile_topology={spec.name} needs libtpu, the TPU compiler: pip install 'maxbridge[tpu]'")
  from jax.experimental import topologies

  try:
    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=f"{spec.chip_name}:{'x'.join(map(str, spec.shape))}",
        num_slices=spec.num_slices,
        # A 3-D torus chip's two TensorCores as one device, as JAX runs them (v4 would list each core).
        chip_config_name="megacore" if spec.chip.dims == 3 else "default",
        # A host holds 2x2 chips (libtpu's default), or the whole of a smaller slice.
        chips_per_host_bounds=(*(min(size, 2) for size in spec.shape[:2]), 1),
    )
  except Exception as e:  # libtpu unable to describe it: JAX raises its runtime error
    raise ConfigError(f"compile_topology={spec.name}: libtpu cannot describe {spec.shape} chips: {e}") from e
  return list(topology.devices)


_OOM = re.compile(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")


def out_of_memory(error: Exception) -> tuple[float, float] | None:
  """(needed, available) bytes when `error` is the TPU compiler's out-of-HBM verdict; None for any other."""
  match = _OOM.search(str(error))
  if "RESOURCE_EXHAUSTED" not in str(error) or not match:
    return None
  scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  return float(match.group(1)) * scale[match.group(2)], float(match.group(3)) * scale[match.group(4)]


def roofline_seconds(spec: Target, flops: float, bytes_accessed: float) -> float:
  """A chip's step time if it ran at its peak matmul rate or its HBM bandwidth, whichever binds."""
  return max(flops / (spec.chip.bf16_tflops * 1e12), bytes_accessed / (spec.chip.hbm_gbps * 1e9))
