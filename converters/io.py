"""Streaming checkpoint I/O: find a checkpoint, read it array by array, write it group by group.

Reading restores one array per call (orbax's PLACEHOLDER leaves skip the rest),
so memory holds one array, not the checkpoint. Writing uses orbax's partial
saves (`orbax.checkpoint.v1.partial`): each call adds a group of arrays to a
staged checkpoint, and `finalize` merges them into one OCDBT checkpoint, which
is then laid out as a CheckpointManager step (`<dir>/<step>/items`), the same
as `maxbridge.checkpointing.Checkpointer` writes and restores.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import v1 as ocp_v1

from converters import layouts
from converters.errors import ConversionError
from converters.plan import Leaf

ITEM = "items"  # CheckpointManager's item name, as MaxText and maxbridge save
CONFIG = "config.yml"


# --- finding a checkpoint -------------------------------------------------------


def resolve(path: str | os.PathLike) -> tuple[Path, int | None]:
  """(items directory, step) of a run, checkpoints, step or items directory; the latest step."""
  given = Path(path)
  if not given.exists():
    raise ConversionError(f"{given}: no such file or directory")
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
    raise ConversionError(
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


# --- reading --------------------------------------------------------------------


class CheckpointReader:
  """One checkpoint, read through normal paths (see `converters.layouts`), one array at a time."""

  def __init__(self, path: str | os.PathLike):
    self.items, self.step = resolve(path)
    self._handler = ocp.PyTreeCheckpointHandler()
    try:
      self.tree = self._handler.metadata(epath.Path(self.items.absolute())).tree
    except Exception as e:  # orbax raises many types for a bad folder; all mean the same here
      raise ConversionError(f"cannot read the checkpoint metadata in {self.items}: {e}") from e
    self.stored = layouts.flatten_tree(self.tree)
    try:
      self.layout = layouts.detect(self.stored)
      self._normal = layouts.normal_paths(self.stored, self.layout)
    except layouts.LayoutError as e:
      raise ConversionError(f"{self.items}: {e}") from e
    self._stored_path = {normal: stored for stored, normal in self._normal.items()}
    for stored in self._normal:
      if not hasattr(self.stored[stored], "shape"):
        raise ConversionError(
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
      raise ConversionError(
          f"cannot read {stored} from {self.items} (its data is damaged or incomplete): " f"{type(e).__name__}: {e}"
      ) from e
    want = self.leaves[normal]
    if array.shape != want.shape:
      raise ConversionError(f"{stored} in {self.items} holds shape {array.shape}, but its metadata says {want.shape}")
    self.reads += 1
    return array.astype(want.dtype, copy=False)


# --- writing --------------------------------------------------------------------


class CheckpointWriter:
  """Writes `<directory>/<step>/items` group by group; nothing is there until `finalize`.

  `skeleton` is the whole tree to write (see `layouts.build_tree`), with
  `Leaf`s for arrays: a partial save may only add keys, never repeat one, so
  the writer needs the whole structure up front. Arrays arrive with
  `add(path, array)` and are saved in groups of at most `group_bytes` (or one
  larger array). A list's later entries (Linen's optimizer chain: `[adam,
  None, schedule]`) can only be saved together with its earlier ones, so those
  leaves, and the smallest leaf of each earlier entry, wait for the last group;
  in MaxText's layout that is only the two counts and the empty state.
  """

  def __init__(self, directory: Path, step: int, skeleton: Any, *, group_bytes: int = 64 << 20):
    self.directory = Path(directory).absolute()
    self.step = step
    self.group_bytes = group_bytes
    self._skeleton = skeleton
    keyed = jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=lambda x: x is None)[0]
    self._keys = {layouts.keypath_str(k): tuple(k) for k, _ in keyed}
    self._last = _last_group(keyed)
    self._pending: dict[tuple, Any] = {}
    self._held: dict[tuple, Any] = {k: None for k, leaf in keyed if leaf is None}
    self._pending_bytes = 0
    self._session = self.directory / str(step)

  def add(self, path: str, array: np.ndarray) -> None:
    key = self._keys[path]
    if key in self._last:
      self._held[key] = array
      return
    if self._pending and self._pending_bytes + array.nbytes > self.group_bytes:
      self._flush()  # so a group never holds more than group_bytes, or one larger array
    self._pending[key] = array
    self._pending_bytes += array.nbytes
    if self._pending_bytes >= self.group_bytes:
      self._flush()

  def _flush(self) -> None:
    self._save(self._pending)
    self._pending, self._pending_bytes = {}, 0

  def finalize(self) -> Path:
    """Saves what is left, merges the groups, and lays the result out as `<step>/items`."""
    self._save({**self._pending, **self._held})
    self._pending = self._held = {}
    ocp_v1.partial.finalize(self._session)
    staged = [d for d in self._session.iterdir() if (d / "_METADATA").is_file()]
    if len(staged) != 1:
      raise ConversionError(f"orbax left {len(staged)} item folders in {self._session}; expected 1")
    staged[0].rename(self._session / ITEM)
    # The step folder as CheckpointManager(item_handlers={"items": PyTreeCheckpointHandler()})
    # leaves it, so our Checkpointer (and MaxText) list and restore it.
    (self._session / "orbax.checkpoint").unlink(missing_ok=True)
    meta_file = self._session / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    handler = ocp.PyTreeCheckpointHandler
    meta["item_handlers"] = {ITEM: f"{handler.__module__}.{handler.__qualname__}"}
    meta_file.write_text(json.dumps(meta))
    return self._session / ITEM

  def _save(self, group: Mapping[tuple, Any]) -> None:
    # Synchronous on purpose: writing one group while reading the next was
    # ~10% faster here but held a second group in memory.
    if not group:
      return
    context = ocp_v1.Context()
    context.array.saving.use_zarr3 = False  # as CheckpointManager saves by default
    context.memory.deepcopy_host_arrays = False  # nothing mutates these arrays; a copy would double memory
    with context:
      ocp_v1.partial.save(self._session, _prune(self._skeleton, (), group))


_MISSING = object()


def _prune(node: Any, prefix: tuple, group: Mapping[tuple, Any]) -> Any:
  """The part of `node` whose leaves are in `group`, with group's values; lists keep their prefix."""
  if isinstance(node, Mapping):
    kept = {}
    for key, child in node.items():
      sub = _prune(child, prefix + (jax.tree_util.DictKey(key),), group)
      if sub is not _MISSING:
        kept[key] = sub
    return kept or _MISSING
  if isinstance(node, list):
    kept = [_prune(child, prefix + (jax.tree_util.SequenceKey(i),), group) for i, child in enumerate(node)]
    present = [i for i, sub in enumerate(kept) if sub is not _MISSING]
    if not present:
      return _MISSING
    if len(present) != present[-1] + 1:
      raise AssertionError(f"list entries {present} saved without the earlier ones")  # _last_group prevents this
    return kept[: present[-1] + 1]
  return group.get(prefix, _MISSING)


def _last_group(keyed: list) -> set[tuple]:
  """Leaves to save in the last group: everything below a list entry other than the first,
  and the smallest leaf of every earlier entry (see CheckpointWriter)."""
  last = set()
  for key, leaf in keyed:
    for depth, part in enumerate(key):
      if isinstance(part, jax.tree_util.SequenceKey) and part.idx > 0:
        last.add(key)
        for earlier in range(part.idx):
          anchor = key[:depth] + (jax.tree_util.SequenceKey(earlier),)
          below = [(k, l) for k, l in keyed if k[: len(anchor)] == anchor]
          last.add(min(below, key=lambda kl: 0 if kl[1] is None else kl[1].nbytes)[0])
  return last


def remove(path: Path) -> None:
  """Removes a folder we created (a staging folder); never a source."""
  shutil.rmtree(path, ignore_errors=True)
