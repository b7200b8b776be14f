"""Streaming checkpoint writes, group by group; `maxbridge.checkpointing.CheckpointReader` reads.

Writing uses orbax's partial saves (`orbax.checkpoint.v1.partial`): each call
adds a group of arrays to a staged checkpoint, and `finalize` merges them into
one OCDBT checkpoint, which is then laid out as a CheckpointManager step
(`<dir>/<step>/items`), the same as `maxbridge.checkpointing.Checkpointer`
writes and restores.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp_v1

from converters.errors import ConversionError
from maxbridge import layouts
from maxbridge.checkpointing import ITEM

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
