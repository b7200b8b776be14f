"""Orbax checkpoints in MaxText's layout: `<dir>/<step>/items/` holding the on-disk tree.

Both backends save and restore the same tree (see `maxbridge.state`). Orbax
writes each step into a temporary folder and renames it when complete, so a
save killed midway leaves no step that restores half-written.

`Checkpointer` saves and restores whole train states; `CheckpointReader` and
`load_params` read any checkpoint (ours, MaxText's Linen or NNX, params-only)
one array at a time, for `maxbridge.hf` and the converters.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxbridge import canonical, layouts
from maxbridge.config import Config, load_config

ITEM = "items"  # CheckpointManager's item name, as MaxText and maxbridge save
CONFIG = "config.yml"
# Subtrees a loader may ignore: MaxText's NNX path saves its RNG state here.
IGNORED_SUBTREES = layouts.IGNORED


class CheckpointError(ValueError):
  pass


def _paths(tree: Any) -> dict[str, Any]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {layouts.keypath_str(path): leaf for path, leaf in leaves}


def _foreign_layout(tree: Any):
  """The layout of a checkpoint written in another layout (NNX, older MaxText NNX); None for ours.

  `maxbridge.layouts` is the one place that maps layouts; an unknown tree
  is left to the path checks below, which name what does not match.
  """
  try:
    layout = layouts.detect(tree)
  except layouts.LayoutError:
    return None
  return None if layout.is_normal or layout.kind == layouts.CANONICAL else layout


def _params_first(item) -> tuple[bool, str]:
  # Parameters before their optimizer-state echoes: the first line is the one to read.
  path = item[0] if isinstance(item, tuple) else item
  return (not path.startswith("params/"), path)


class Checkpointer:
  """A CheckpointManager over `directory`, with checked restores."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None):
    self.directory = os.fspath(directory)
    self.manager = ocp.CheckpointManager(
        os.path.abspath(self.directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        # Named up front so metadata can be read before any save or restore.
        item_handlers={ITEM: ocp.PyTreeCheckpointHandler()},
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, tree: dict) -> None:
    """Starts an asynchronous save; arrays are copied off the live state before it returns."""
    self.manager.save(step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

  def restore(self, step: int, target: dict) -> dict:
    """Restores `step` into the abstract `target` tree, after checking every path and shape."""
    if step not in self.manager.all_steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {self.all_steps()}")
    stored_tree = self.manager.item_metadata(step)["items"].tree
    layout = _foreign_layout(stored_tree)
    stored = _paths(layouts.normalize(stored_tree, layout) if layout else stored_tree)
    wanted = _paths(target)
    where = f"checkpoint {os.path.join(self.directory, str(step))}"
    missing = sorted(set(wanted) - set(stored), key=_params_first)
    unknown = sorted(
        (p for p in set(stored) - set(wanted) if p.split("/")[0] not in IGNORED_SUBTREES),
        key=_params_first,
    )
    if missing or unknown:
      lines = [f"  missing: {p} {tuple(wanted[p].shape)}" for p in missing[:20]]
      lines += [f"  unexpected: {p}" for p in unknown[:20]]
      raise CheckpointError(f"{where} does not match the model:\n" + "\n".join(lines))
    misshaped = [
        f"  {path} has shape {tuple(stored[path].shape)}, the model expects {tuple(want.shape)}"
        for path, want in sorted(wanted.items(), key=_params_first)
        if tuple(stored[path].shape) != tuple(want.shape)
    ]
    if misshaped:
      more = f"\n  ... and {len(misshaped) - 20} more" if len(misshaped) > 20 else ""
      raise CheckpointError(f"{where} does not match the model:\n" + "\n".join(misshaped[:20]) + more)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or device),
        target,
    )
    # A checkpoint in another layout is read in its own structure, then renamed.
    on_disk = layouts.stored_like(stored_tree, layout, target) if layout else target
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            items=ocp.args.PyTreeRestore(
                on_disk,
                restore_args=ocp.checkpoint_utils.construct_restore_args(on_disk),
                # Only the ignored subtrees can be left behind: checked above.
                partial_restore=True,
            )
        ),
    )
    return layouts.normalize(restored["items"], layout) if layout else restored["items"]


# --- any checkpoint, read array by array -------------------------------------------


def resolve(path: str | os.PathLike) -> tuple[Path, int | None]:
  """(items directory, step) of a run, checkpoints, step or items directory; the latest step."""
  given = Path(path)
  if not given.exists():
    raise CheckpointError(f"{given}: no such file or directory")
  if (given / "_METADATA").is_file():
    return given, _step_of(given.parent)
  if (given / ITEM).is_dir():
    return given / ITEM, _step_of(given)
  checkpoints = given / "checkpoints" if (given / "checkpoints").is_dir() else given
  steps = (
      sorted(int(d.name) for d in checkpoints.iterdir() if d.name.isdigit() and (d / ITEM / "_METADATA").is_file())
      if checkpoints.is_dir()
      else []
  )
  if not steps:
    raise CheckpointError(
        f"{given} is not a checkpoint: expected a run directory (holding checkpoints/<step>/items), "
        f"a checkpoints directory (holding <step>/items), a step directory (holding items/) or an "
        f"items directory (holding _METADATA)"
    )
  return checkpoints / str(steps[-1]) / ITEM, steps[-1]


def _step_of(step_dir: Path) -> int | None:
  return int(step_dir.name) if step_dir.name.isdigit() else None


def find_config(items: Path) -> Path | None:
  """The config.yml of the run a checkpoint belongs to: next to its steps, or in the run directory."""
  checkpoints = items.parent.parent
  for candidate in (checkpoints / CONFIG, checkpoints.parent / CONFIG):
    if candidate.is_file():
      return candidate
  return None


@dataclasses.dataclass(frozen=True)
class Leaf:
  """An array's shape and dtype, as a checkpoint's metadata gives them: all a conversion plan needs."""

  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class CheckpointReader:
  """One checkpoint in any layout, read through normal paths (see `maxbridge.layouts`), one array at a time.

  Each read restores one array (orbax's PLACEHOLDER leaves skip the rest), so
  memory holds one array, not the checkpoint.
  """

  def __init__(self, path: str | os.PathLike):
    self.items, self.step = resolve(path)
    self._handler = ocp.PyTreeCheckpointHandler()
    try:
      self.tree = self._handler.metadata(epath.Path(self.items.absolute())).tree
    except Exception as e:  # orbax raises many types for a bad folder; all mean the same here
      raise CheckpointError(f"cannot read the checkpoint metadata in {self.items}: {e}") from e
    self.stored = layouts.flatten_tree(self.tree)
    try:
      self.layout = layouts.detect(self.stored)
      self._normal = layouts.normal_paths(self.stored, self.layout)
    except layouts.LayoutError as e:
      raise CheckpointError(f"{self.items}: {e}") from e
    self._stored_path = {normal: stored for stored, normal in self._normal.items()}
    for stored in self._normal:
      if not hasattr(self.stored[stored], "shape"):
        raise CheckpointError(
            f"{stored} in {self.items} is a {type(self.stored[stored]).__name__}, not an array; "
            "checkpoints of arrays only are supported"
        )
    self.leaves = {
        normal: Leaf(tuple(self.stored[s].shape), layouts.layout_dtype(normal, self.stored[s].dtype, layouts.LINEN))
        for s, normal in self._normal.items()
    }
    self.reads = 0

  def read(self, normal: str) -> np.ndarray:
    """The array at a normal path, as a numpy array (the step as int32)."""
    stored = self._stored_path[normal]
    item = jax.tree_util.tree_map_with_path(
        lambda key, _: 0 if layouts.keypath_str(key) == stored else ocp.PLACEHOLDER, self.tree
    )
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    try:
      restored = self._handler.restore(
          epath.Path(self.items.absolute()),
          args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args),
      )
      array = np.asarray(layouts.flatten_tree(restored)[stored])
    except Exception as e:  # tensorstore reports damaged data in several types
      raise CheckpointError(
          f"cannot read {stored} from {self.items} (its data is damaged or incomplete): " f"{type(e).__name__}: {e}"
      ) from e
    want = self.leaves[normal]
    if array.shape != want.shape:
      raise CheckpointError(f"{stored} in {self.items} holds shape {array.shape}, but its metadata says {want.shape}")
    self.reads += 1
    return array.astype(want.dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  """Where `load_params` read from, and what it found there."""

  items: Path
  step: int | None
  layout: layouts.Layout
  config: Config | None  # the run's config.yml, when the checkpoint has one


def load_params(path: str | os.PathLike, *, dtype: Any = None) -> tuple[dict, CheckpointInfo]:
  """The canonical parameter tree of any checkpoint this package reads, as numpy arrays.

  `path`: a run, checkpoints, step or items directory (the latest step is
  taken) in any layout: ours, MaxText's Linen or NNX checkpoints, params-only
  decode checkpoints. The tree is as stored, scanned or not; give it to
  `Model.load_params` (which stacks or unstacks it to fit the model). Reads
  parameters only, one array at a time.
  """
  reader = CheckpointReader(path)
  prefix = "params/params/"
  flat = {p[len(prefix) :]: reader.read(p) for p in reader.leaves if p.startswith(prefix)}
  tree = canonical.unflatten(flat)
  if dtype is not None:
    tree = layouts.cast_floating(tree, dtype)
  config_file = find_config(reader.items)
  config = load_config(str(config_file)) if config_file else None
  return tree, CheckpointInfo(reader.items, reader.step, reader.layout, config)
