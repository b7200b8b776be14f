"""`maxbridge convert`: one checkpoint to another layout, scan form or dtype, array by array."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from converters import keys, ocdbt, plan, storage
from converters.errors import ConversionError
from converters.source import Source, per_layer
from maxbridge.core import canonical, checkpointing, config_keys, files, layouts
from maxbridge.core.config import Config, ConfigError, load_config
from maxbridge.interop.hf.folders import abstract_params

# Below this many bytes a conversion takes a moment: no progress bar.
PROGRESS_BYTES = 256 << 20
# Tags of the hidden folders beside a destination (see `maxbridge.core.files.temp_dir_beside`).
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
  arrays_decoded: int  # read by decoding them; the others' stored bytes were copied or renamed
  arrays_written: int
  nbytes: int
  seconds: float
  config: Path | None  # the config.yml written, if the source had one

  def summary(self) -> str:
    return "\n".join(
        [
            f"source:      {self.source}: {self.source_layout.describe()}",
            f"destination: {self.destination}: {self.layout.describe()}",
            f"step {self.step}: read {self.arrays_read} arrays ({self.arrays_decoded} decoded), wrote "
            f"{self.arrays_written} "
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
  axis: int  # the layer axis of the result's stacks
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
    group_bytes: int = keys.BLOCK_BYTES,
) -> Conversion:
  """Converts the checkpoint at `source` into a CheckpointManager directory `destination`.

  `source`: a run, checkpoints, step or items directory (the latest step is
  taken); its layout is detected. The result is `destination/<step>/items`,
  restorable by `maxbridge.core.checkpointing.Checkpointer(destination)`. The
  source run's config.yml, adjusted to the new scan form and dtype, goes into
  `destination`; or, when `destination` is a run's `checkpoints/`, into that
  run directory, naming it (so `maxbridge train <run>/config.yml` resumes there).

  layout: "linen" or "nnx" (default: the source's). scan_layers: stack or
  unstack the layers (default: as the source). param_scan_axis: the layer axis
  to stack or unstack on (default: the source config's, else 1). dtype:
  "float32" or "bfloat16" for floating-point arrays, optimizer state included.
  params_only: drop optimizer state and step. force: replace an existing
  destination. config: a preset or YAML path describing a source that has no
  config.yml (MaxText's checkpoints); it is checked and written with the result.
  Everything is checked against the metadata before any array is read; the
  destination appears only when complete; the source is only read.

  Nothing is decoded that need not be (see `converters.storage`): arrays that
  only change name (Linen <-> NNX) are renamed, and stacks stored one chunk
  per layer (as maxbridge saves and converts them) are unstacked, or layers
  stacked, by moving their chunks; when nearly everything is moved so, the
  source's data files are linked (copied where they cannot be) and the new
  names point into them: no array's bytes are written.
  A stack stored as one chunk (orbax's default, as MaxText saves on one
  device) or a few (one per device shard) is decoded a piece at a time, each
  piece a part of every layer, and the layers are written chunked by those
  pieces. A cast or a moved layer axis is decoded one array at a time and
  written in pieces of at most `group_bytes`.
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
  nbytes = sum(leaf.nbytes for leaf in job.stored.values())
  done, dest = False, None
  try:
    source = Source(reader)
    actions = [(step, _action(step, reader, source, job)) for step in job.steps]
    dest = _start(reader, source, actions, staging / str(job.step) / checkpointing.ITEM, group_bytes)
    show = progress if progress is not None else nbytes >= PROGRESS_BYTES
    with tqdm(
        total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not show, file=sys.stderr, desc="convert"
    ) as bar:
      arrays = decoded = 0
      digests = {}  # of the arrays written, by stored path: see `_decode` and `_carried`
      for step, action in actions:
        if action is None:
          digests.update(_decode(step, source, dest, job))
          decoded += len(step.inputs)
        else:
          if not dest.copied:
            action.apply(dest, source)
          digests.update(_carried(step, reader, job))
        arrays += len(step.outputs)
        bar.set_postfix_str(f"{arrays}/{len(job.stored)} arrays", refresh=False)
        bar.update(sum(leaf.nbytes for _, leaf in step.outputs))
    dest.finish(skeleton, job.step, digests)
    if job.config and job.config_file.parent == destination:
      job.config.to_yaml(staging / checkpointing.CONFIG)
    _replace(staging, destination)
    done = True
  finally:
    if dest is not None:
      dest.settle()
    shutil.rmtree(staging, ignore_errors=True)
    if created is not None and not done:
      shutil.rmtree(created, ignore_errors=True)
  if job.config and job.config_file.parent != destination:
    job.config.to_yaml(job.config_file)
  return Conversion(
      source=reader.items,
      source_layout=reader.layout,
      destination=destination / str(job.step) / checkpointing.ITEM,
      layout=layouts.detect(skeleton),
      step=job.step,
      arrays_read=sum(len(step.inputs) for step in job.steps),
      arrays_decoded=decoded,
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
  own = _load(checkpointing.find_config(reader.items))
  config = load_config(os.fspath(given)) if given is not None else own
  if given is not None and own is not None and (differ := config_keys.contradictions(own, config)):
    raise ConversionError(
        f"--config {os.fspath(given)} contradicts the source's config.yml, which describes its checkpoints "
        f"({'; '.join(differ[:8])}): drop --config (the source's own is read), or give one that agrees"
    )
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
  return _Job(steps, stored, kind, axis, _step_number(reader), new_config, config_file)


def _name(normal: str, kind: str) -> str:
  return layouts.layout_path(normal, kind).replace("/", ".")  # orbax's name for the array in its store


@dataclasses.dataclass(frozen=True)
class _Relabel:
  """A step done on stored bytes alone: arrays renamed (`renames`, {source normal path: name}), or chunks
  moved between a stack and its layers (`moves`: source normal path, chunk index, new name, new index)."""

  renames: dict[str, str]
  moves: list[tuple[str, tuple[int, ...], str, tuple[int, ...]]]
  zarrays: dict[str, dict]  # .zarray of each new array made of moved chunks

  def apply(self, dest: storage.Destination, source: Source) -> None:
    """Into a database that does not share the source's files: the encoded bytes are copied."""
    for normal, name in self.renames.items():
      dest.copy_keys(source, normal, name)
    for name, meta in self.zarrays.items():
      dest.describe(name, meta)
    for normal, index, name, new_index in self.moves:
      dest.relocate(source, normal, index, name, new_index)


def _action(step: plan.Step, reader, source: Source, job: _Job) -> _Relabel | None:
  """How a step is done without decoding, or None when it must decode (a cast, a moved axis, or a stack
  stored in one chunk, as orbax saves it). Reads metadata only."""
  outputs = [(_name(path, job.kind), job.stored[path]) for path, _ in step.outputs]
  # Encoded bytes are reused only from zarr v2 in OCDBT (`Source.raw`), and only when no dtype changes.
  if not source.raw or any(reader.stored_leaf(n).dtype != leaf.dtype for n in step.inputs for _, leaf in outputs):
    return None
  first, axis = step.inputs[0], step.axis
  if step.op == "copy":
    return _Relabel({first: outputs[0][0]}, [], {})
  if step.op == "unstack" and per_layer(meta := source.zarray(first), axis):
    zarrays = {
        name: {**meta, "shape": list(leaf.shape), "chunks": plan.without_axis(meta["chunks"], axis)}
        for name, leaf in outputs
    }
    moves = [(first, index, outputs[index[axis]][0], plan.without_axis(index, axis)) for index in source.chunks(first)]
    return _Relabel({}, moves, zarrays)
  if step.op == "stack" and _alike(metas := [source.zarray(n) for n in step.inputs]):
    ((name, leaf),) = outputs
    chunks = metas[0]["chunks"][:axis] + [1] + metas[0]["chunks"][axis:]
    moves = [
        (n, index, name, index[:axis] + (i,) + index[axis:])
        for i, n in enumerate(step.inputs)
        for index in source.chunks(n)
    ]
    return _Relabel({}, moves, {name: {**metas[0], "shape": list(leaf.shape), "chunks": chunks}})
  return None


def _carried(step: plan.Step, reader, job: _Job) -> dict[str, str]:
  """The source's digest of an array renamed as it is (same bytes, dtype and shape), under its new name.

  Arrays made of moved chunks (a stack unstacked or layers stacked without
  decoding) get none: their digest would need the decoding the move avoids.
  """
  if step.op != "copy" or (recorded := reader.recorded_digest(step.inputs[0])) is None:
    return {}
  return {layouts.layout_path(step.outputs[0][0], job.kind): recorded}


def _digests(outputs: list[tuple[str, checkpointing.Leaf]], values: list[np.ndarray], job: _Job) -> dict[str, str]:
  """{stored path: digest} of outputs written from whole arrays in hand, in the dtype they are stored in."""
  return {
      layouts.layout_path(path, job.kind): checkpointing.digest(np.asarray(array, job.stored[path].dtype))
      for (path, _), array in zip(outputs, values)
  }


def _start(reader, source: Source, actions, items: Path, block_bytes: int) -> storage.Destination:
  """The destination database, holding the relabelled arrays already when it shares the source's files.

  When nearly every source array is relabelled (renamed from Linen to NNX,
  or its chunks moved between a stack and its layers), the source's data
  files are copied as files and the new keys point at the same bytes: one
  transaction, nothing read. The few others (the step's integer type) are
  written next to them. Otherwise the database starts empty, so that it
  holds no data of arrays it no longer names, and relabelled arrays have
  their encoded bytes copied.
  """
  relabels = [action for _, action in actions if action is not None]
  kept = {n for a in relabels for n in a.renames} | {move[0] for a in relabels for move in a.moves}
  left_behind = sum(leaf.nbytes for normal, leaf in reader.leaves.items() if normal not in kept)
  renames = {reader.name(n): name for a in relabels for n, name in a.renames.items()}
  renames = {old: new for old, new in renames.items() if old != new}
  unchanged = {reader.name(n) for a in relabels for n, name in a.renames.items()} - set(renames)
  gone = sorted({path.replace("/", ".") for path in reader.stored} - unchanged)
  new = set(renames.values()) | {move[2] for a in relabels for move in a.moves}
  if not source.raw or left_behind * 64 > sum(l.nbytes for l in reader.leaves.values()) or new & set(gone):
    return storage.Destination(items, block_bytes=block_bytes)
  # Copied files are never decoded, so check first that they hold what the index points at.
  if problem := ocdbt.missing_data(reader.items):
    raise ConversionError(
        f"cannot read {reader.items} (its data is damaged or incomplete): {problem}"
        f"{checkpointing.intact_before(reader.items)}"
    )
  dest = storage.Destination(items, copy_from=reader.items, block_bytes=block_bytes)
  moves = [(reader.name(n), index, name, new_index) for a in relabels for n, index, name, new_index in a.moves]
  dest.relabel(renames, moves, gone)
  for action in relabels:
    for name, meta in action.zarrays.items():
      dest.describe(name, meta)
  return dest


def _alike(metas: list[dict | None]) -> bool:
  """Whether stored layers share dtype, encoding and chunking, so their chunks can be stacked as they are."""
  if any(m is None for m in metas):
    return False
  return all({**m, "shape": None} == {**metas[0], "shape": None} for m in metas)


def _decode(step: plan.Step, source: Source, dest: storage.Destination, job: _Job) -> dict[str, str]:
  """Reads and writes through the zarr driver: one source array (or one layer) and one block at a time, or
  a stack's chunks piece by piece (`storage.Destination.unstack`). Returns the digests of the outputs that
  were whole in memory (those written a piece at a time get none)."""
  outputs = [(_name(path, job.kind), job.stored[path]) for path, _ in step.outputs]
  if step.op == "stack":
    ((name, leaf),) = outputs
    array = dest.create(name, leaf.shape, leaf.dtype, layer_axis=step.axis)
    for i, layer_path in enumerate(step.inputs):
      values = np.expand_dims(source.read_array(layer_path), step.axis)
      for index in storage.blocks(array):
        if index[step.axis] == slice(i, i + 1) or (leaf.shape[step.axis] == 1 and index[step.axis] == slice(None)):
          block = index[: step.axis] + (slice(None),) + index[step.axis + 1 :]
          dest.write(array, index, np.asarray(values[block], leaf.dtype, order="C"))
    return {}
  first = step.inputs[0]
  if step.op == "unstack":
    if dest.unstack(source, first, step.axis, outputs):
      return {}
    digests = {}
    stored = source.reader.open(first)
    by_layer = stored is not None and stored.chunk_layout.read_chunk.shape[step.axis] == 1
    whole = None if by_layer else source.read_array(first)
    for i, (name, leaf) in enumerate(outputs):
      at = (slice(None),) * step.axis + (i,)
      # A stack chunked by layer is read a layer at a time (a tensorstore slice decodes only its chunks).
      layer = np.asarray(stored[at].read().result()) if by_layer else whole[at]
      dest.write_all(dest.create(name, leaf.shape, leaf.dtype), layer)
      digests.update(_digests([step.outputs[i]], [layer], job))
      del layer
    return digests
  ((name, leaf),) = outputs
  stacked = canonical.is_stacked(step.outputs[0][0])
  layer_axis = job.axis if stacked else None
  if step.op == "copy" and dest.copy_pieces(source, first, name, leaf, layer_axis):
    return {}
  values = source.read_array(first)
  if step.op == "moveaxis":
    values = np.moveaxis(values, step.source_axis, step.axis)
  dest.write_all(dest.create(name, leaf.shape, leaf.dtype, layer_axis=layer_axis), values)
  return _digests(step.outputs, [values], job)


def _check_config_describes(config: Config, stored: dict[str, checkpointing.Leaf], items: Path) -> None:
  """The config.yml written beside the result must describe its parameters, or it would not load."""
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
