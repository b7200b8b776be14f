"""`maxbridge convert`: one checkpoint to another layout, scan form or dtype, array by array."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from converters import io, plan
from converters.errors import ConversionError
from maxbridge import canonical, checkpointing, files, layouts
from maxbridge.config import Config, ConfigError, load_config

# Below this many bytes a conversion takes a moment: no progress bar.
PROGRESS_BYTES = 256 << 20
# Tags of the hidden folders beside a destination (see `maxbridge.files.temp_dir_beside`).
STAGING = "converting"
REPLACED = "replaced"


@dataclasses.dataclass(frozen=True)
class Conversion:
  """What `convert` did."""

  source: Path  # the items directory read
  source_layout: layouts.Layout
  destination: Path  # the items directory written
  layout: layouts.Layout
  step: int
  arrays_read: int
  arrays_written: int
  nbytes: int
  seconds: float
  config: Path | None  # the config.yml written, if the source had one

  def summary(self) -> str:
    return "\n".join(
        [
            f"source:      {self.source}: {self.source_layout.describe()}",
            f"destination: {self.destination}: {self.layout.describe()}",
            f"step {self.step}: read {self.arrays_read} arrays, wrote {self.arrays_written} "
            f"({self.nbytes / 2**20:.1f} MiB) in {self.seconds:.1f} s",
            f"config:      {self.config or 'none (the source has no config.yml)'}",
        ]
    )


@dataclasses.dataclass(frozen=True)
class _Job:
  """A checked conversion, before any array is read."""

  steps: list[plan.Step]
  stored: dict[str, checkpointing.Leaf]  # output normal path -> shape and dtype as written
  kind: str
  step: int
  config: Config | None
  config_file: Path | None


def convert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    layout: str | None = None,
    scan_layers: bool | None = None,
    param_scan_axis: int | None = None,
    dtype: str | None = None,
    params_only: bool = False,
    force: bool = False,
    config: str | os.PathLike | None = None,
    progress: bool | None = None,
    group_bytes: int = 64 << 20,
) -> Conversion:
  """Converts the checkpoint at `source` into a CheckpointManager directory `destination`.

  `source`: a run, checkpoints, step or items directory (the latest step is
  taken); its layout is detected. The result is `destination/<step>/items`,
  restorable by `maxbridge.checkpointing.Checkpointer(destination)`. The
  source run's config.yml, adjusted to the new scan form and dtype, goes into
  `destination`; or, when `destination` is a run's `checkpoints/`, into that
  run directory, naming it (so `maxbridge train <run>/config.yml` resumes there).

  layout: "linen" or "nnx" (default: the source's). scan_layers: stack or
  unstack the layers (default: as the source). param_scan_axis: the layer axis
  to stack or unstack on (default: the source config's, else 1). dtype:
  "float32" or "bfloat16" for floating-point arrays, optimizer state included.
  params_only: drop optimizer state and step. force: replace an existing
  destination. config: a preset or YAML path describing a source that has no
  config.yml (MaxText's checkpoints); it is checked and written with the result. Everything is checked against the metadata before any array is
  read; the destination appears only when complete; the source is only read.
  Memory holds about one array (one layer stack when stacking or unstacking)
  plus `group_bytes` waiting to be written.
  """
  began = time.perf_counter()
  reader = checkpointing.CheckpointReader(source)
  destination = Path(destination).absolute()
  _check_destination(reader.items, destination, force)
  job = _prepare(reader, destination, layout, scan_layers, param_scan_axis, dtype, params_only, force, config)
  skeleton = layouts.build_tree(job.stored, job.kind)

  # The outermost folder this call creates, removed again if the conversion fails.
  created = next((p for p in reversed(destination.parents) if not p.exists()), None)
  destination.parent.mkdir(parents=True, exist_ok=True)
  # Named for this process: the next conversion to `destination` removes it if a kill left it behind.
  staging = files.temp_dir_beside(destination, STAGING)
  done = False
  try:
    writer = io.CheckpointWriter(staging, job.step, skeleton, group_bytes=group_bytes)
    nbytes = sum(leaf.nbytes for leaf in job.stored.values())
    show = progress if progress is not None else nbytes >= PROGRESS_BYTES
    with tqdm(total=len(job.stored), unit="array", disable=not show, file=sys.stderr, desc="convert") as bar:
      for step in job.steps:
        for path, array in step.run(reader.read):
          writer.add(layouts.layout_path(path, job.kind), array.astype(job.stored[path].dtype, copy=False))
          del array  # not held while the next one is read: the writer has it, or has written it
          bar.update()
    writer.finalize()
    if job.config and job.config_file.parent == destination:
      job.config.to_yaml(staging / checkpointing.CONFIG)
    _replace(staging, destination)
    done = True
  finally:
    io.remove(staging)
    if created is not None and not done:
      io.remove(created)
  if job.config and job.config_file.parent != destination:
    job.config.to_yaml(job.config_file)
  return Conversion(
      source=reader.items,
      source_layout=reader.layout,
      destination=destination / str(job.step) / checkpointing.ITEM,
      layout=layouts.detect(skeleton),
      step=job.step,
      arrays_read=reader.reads,
      arrays_written=len(job.stored),
      nbytes=nbytes,
      seconds=time.perf_counter() - began,
      config=job.config_file if job.config else None,
  )


def _prepare(reader, destination, layout, scan_layers, param_scan_axis, dtype, params_only, force, given) -> _Job:
  """Checks the request against the source's metadata and plans it; reads no array."""
  kind = layout or (layouts.LINEN if reader.layout.kind == layouts.CANONICAL else reader.layout.kind)
  if kind not in (layouts.LINEN, layouts.NNX):
    raise ConversionError(f"unknown layout {kind!r}; expected 'linen' or 'nnx'")
  if dtype not in (None, "float32", "bfloat16"):
    raise ConversionError(f"unknown dtype {dtype!r}; expected 'float32' or 'bfloat16'")
  config = load_config(os.fspath(given)) if given is not None else _load(checkpointing.find_config(reader.items))
  source_axis, axis = _axes(reader.layout.scanned, scan_layers, param_scan_axis, config)
  steps = plan.build(
      reader.leaves,
      scanned=scan_layers,
      axis=axis,
      source_axis=source_axis,
      dtype=dtype,
      params_only=params_only,
      num_layers=dict(canonical.layer_stacks(config)) if config else None,
  )
  stored = {
      path: checkpointing.Leaf(leaf.shape, layouts.layout_dtype(path, leaf.dtype, kind))
      for step in steps
      for path, leaf in step.outputs
  }
  run_dir = destination.parent if destination.name == "checkpoints" else None
  scanned = reader.layout.scanned if scan_layers is None else scan_layers
  new_config = _adjusted(config, scanned, axis, dtype, run_dir)
  if new_config is not None:
    _check_config_describes(new_config, stored, reader.items)
  config_file = (run_dir or destination) / checkpointing.CONFIG
  if new_config and run_dir and config_file.exists() and not force:
    raise ConversionError(f"{config_file} already exists; pass --force to replace it")
  return _Job(steps, stored, kind, _step_number(reader), new_config, config_file)


def _check_config_describes(config: Config, stored: dict[str, checkpointing.Leaf], items: Path) -> None:
  """The config.yml written beside the result must describe its parameters, or it would not load."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxbridge.hf.folders import abstract_params  # pylint: disable=import-outside-toplevel

  prefix = "params/params/"
  params = {
      p[len(prefix) :]: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for p, leaf in stored.items() if p.startswith(prefix)
  }
  try:
    canonical.check(canonical.unflatten(params), abstract_params(config), config.param_scan_axis)
  except ValueError as e:
    raise ConversionError(
        f"the config (the source's config.yml or --config) does not describe the checkpoint in {items}, so the "
        "result would not "
        f"load; nothing was written. {e}"
    ) from e


def _load(config_file: Path | None) -> Config | None:
  if config_file is None:
    return None
  try:
    return load_config(str(config_file))
  except ConfigError as e:
    raise ConversionError(f"the source's {config_file} is not a valid config: {e}") from e


def _check_destination(items: Path, destination: Path, force: bool) -> None:
  step_dir = items.absolute().parent
  if destination == step_dir or step_dir.is_relative_to(destination) or destination.is_relative_to(step_dir):
    # --force would delete the source with the old destination.
    raise ConversionError(f"the destination {destination} overlaps the source {step_dir}; choose a folder outside it")
  if destination.exists() and not destination.is_dir():
    raise ConversionError(f"{destination} exists and is not a folder")
  if destination.exists() and not force:
    raise ConversionError(f"{destination} already exists; pass --force to replace it")


def _axes(scanned: bool, scan_layers: bool | None, given: int | None, config: Config | None):
  """(layer axis of the source's stacks, layer axis of the result's stacks)."""
  configured = config.param_scan_axis if config else None
  default = next(a for a in (given, configured, 1) if a is not None)
  if scanned and scan_layers is False:
    return default, default  # unstacked on the axis asked for, checked against the shapes
  if scanned:
    source = configured if configured is not None else default
    return source, default  # stays stacked: moved from the source's axis if another is asked for
  return None, default


def _adjusted(config: Config | None, scanned: bool, axis: int, dtype: str | None, run_dir: Path | None) -> Config | None:
  """The source's config, describing the converted checkpoint (and its new run directory)."""
  if config is None:
    return None
  changes = dict(scan_layers=scanned, param_scan_axis=axis, weight_dtype=dtype or config.weight_dtype)
  if run_dir is not None:
    changes.update(run_name=run_dir.name, base_output_directory=str(run_dir.parent))
  try:
    return config.replace(**changes)
  except ConfigError as e:
    raise ConversionError(f"the converted run's config would be invalid: {e}") from e


def _step_number(reader: checkpointing.CheckpointReader) -> int:
  if reader.step is not None:
    return reader.step
  return int(reader.read("step")) if "step" in reader.leaves else 0


def _replace(staging: Path, destination: Path) -> None:
  """Moves the finished staging folder to `destination`, replacing an old destination."""
  old = None
  if destination.exists():
    old = files.temp_dir_beside(destination, REPLACED)
    os.replace(destination, old / destination.name)
  staging.rename(destination)
  if old is not None:
    shutil.rmtree(old)
