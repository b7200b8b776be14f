"""Orbax checkpoints in MaxText's layout: `<dir>/<step>/items/` holding the on-disk tree.

Both backends save and restore the same tree (see `maxbridge.state`). Orbax
writes each step into a temporary folder and renames it when complete, so a
save killed midway leaves no step that restores half-written.

`Checkpointer` saves and restores whole train states; `CheckpointReader` and
`load_params` read any checkpoint (ours, MaxText's Linen or NNX, params-only)
one array at a time, for `maxbridge.hf` and the converters.

Each step also holds `digests/`: a digest of every array saved (`digest`),
computed from the host copy as it is saved and committed with the step (a
second orbax item), so a reader sees digests only of a committed step. Restores,
`CheckpointReader.read` (compare, export, generate) and `maxbridge verify`
check what they read against them; a step without them (MaxText's, older ones)
reads as before, unchecked. What a step folder holds, and how it is found and
checked, is `step_folder`'s.

A save that fails (a full disk, a file where the folder should be) raises
`CheckpointSaveError` from `save` or `wait`, and `close` always returns:
orbax makes a step's folders inside `save` itself here, so no background
thread is ever left waiting for a folder that will never exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from maxbridge.core import canonical, layouts
from maxbridge.core.step_folder import (
    DIGESTS,
    DIGESTS_FILE,
    ITEM,
    CheckpointError,
    DamagedArrayError,
    digest,
    in_stored_dtype,
    intact_before,
    read_digests,
    resolve,
    saved_items,
    step_problem,
    stored_paths,
    tree_digests,
)
from maxbridge.core.config import Config, load_config

CONFIG = "config.yml"
# The step's data iterator state: the orbax item a run's data source gives `save`, read back by `restore_data`
# through the handler its library registered (`register_item`); steps of runs on in-memory data have none.
DATA = "data"
# Items saved beside the state whose handlers the libraries that define them register (`register_item`):
# this module knows none of them, and a `Checkpointer` names every one registered when it is made.
_ITEM_HANDLERS: dict[str, Callable[[], ocp.handlers.CheckpointHandler]] = {}


def register_item(name: str, handler: Callable[[], ocp.handlers.CheckpointHandler]) -> None:
  """Lets each `Checkpointer` made from now on save and restore item `name` with a new `handler()` (a Grain
  pipeline's iterator state, `DATA`, registers its handler when its module is imported)."""
  _ITEM_HANDLERS[name] = handler


# Subtrees a loader may ignore: MaxText's NNX path saves its RNG state here.
IGNORED_SUBTREES = layouts.IGNORED


class CheckpointSaveError(OSError):
  """A save that failed (disk full, unwritable folder); the message names the step and the reason."""


_ORBAX_TMP = ".orbax-checkpoint-tmp"


def describe_last_good(directory: str | os.PathLike, steps: list[int]) -> str:
  """ "step 3 in runs/x/checkpoints", for messages; or that none is there."""
  return f"step {max(steps)} in {directory}" if steps else f"none in {directory}"


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


def _layer_chunks(tree: Any) -> Any:
  """Orbax SaveArgs storing each layer of a stacked array as its own chunk (`shard_axes`), or None.

  Orbax would store a stack as one chunk (per shard): reading one layer would
  decode them all. One chunk per layer lets `maxbridge convert` unstack it by
  moving chunks, decoding nothing, and lets a reader decode one layer at a
  time. The layer axis is the one axis on which every stack agrees (a
  checkpoint does not carry its config); where that is unclear, orbax chooses.
  """
  flat = layouts.flatten_tree(tree)
  try:
    normal = layouts.normal_paths(flat, layouts.detect(flat))
  except layouts.LayoutError:
    return None
  stacks = {s: flat[s].shape for s, n in normal.items() if canonical.is_stacked(n) and hasattr(flat[s], "shape")}
  ranks = [len(shape) for shape in stacks.values()]
  agree = [a for a in range(min(ranks, default=0)) if len({shape[a] for shape in stacks.values()}) == 1]
  if len(agree) != 1:
    return None
  chunked = ocp.SaveArgs(shard_axes=(agree[0],))
  return jax.tree_util.tree_map_with_path(
      lambda key, _: chunked if layouts.keypath_str(key) in stacks else ocp.SaveArgs(), tree
  )


class Checkpointer:
  """A CheckpointManager over `directory`, with checked restores."""

  def __init__(
      self, directory: str | os.PathLike, *, max_to_keep: int | None = None, create: bool = True, digests: bool = True
  ):
    """`create=False` reads a folder that may not exist yet; the first `save` makes it.
    `digests=False` neither records nor checks digests: for measuring what they cost (benchmarks/checkpoint.py)."""
    self.directory = os.fspath(directory)
    self.digests = digests
    self._saving: int | None = None  # the step of the save in flight
    self.manager = ocp.CheckpointManager(
        os.path.abspath(self.directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=create,
            # Made in the caller's thread: a folder that cannot be made raises in save(),
            # instead of leaving orbax's commit threads waiting for it for ever (a hang at exit).
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        ),
        # Named up front so metadata can be read before any save or restore.
        item_handlers={
            ITEM: ocp.PyTreeCheckpointHandler(),
            DIGESTS: ocp.JsonCheckpointHandler(DIGESTS_FILE),
            **{name: handler() for name, handler in _ITEM_HANDLERS.items()},
        },
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def intact_steps(self) -> list[int]:
    """The steps whose folders look restorable (see `step_problem`), oldest first."""
    return [s for s in self.all_steps() if step_problem(self.step_dir(s)) is None]

  def step_dir(self, step: int) -> Path:
    return Path(self.directory) / str(step)

  def latest_intact_step(self) -> int | None:
    """The latest step, checked: a damaged latest step is an error naming the intact step before it.

    Resuming silently from an older step would retrain steps and then collide
    with the damaged folder on its next save; the user decides instead.
    """
    steps = self.all_steps()
    if not steps:
      return None
    problem = step_problem(self.step_dir(steps[-1]))
    if problem is None:
      return steps[-1]
    raise CheckpointError(f"{self.step_dir(steps[-1])} is damaged: {problem}; {self._fallback(steps[-1])}")

  def _fallback(self, damaged: int) -> str:
    earlier = [s for s in self.intact_steps() if s < damaged]
    if not earlier:
      return f"no earlier step in {self.directory} is intact"
    return f"step {earlier[-1]} is intact: move {self.step_dir(damaged)} away (or delete it) to resume from step {earlier[-1]}"

  def remove_temporaries(self) -> None:
    """Removes the folders of saves that never finished (a killed or failed run), before saving again."""
    if os.path.isdir(self.directory):
      for entry in Path(self.directory).iterdir():
        if _ORBAX_TMP in entry.name and entry.name.split(".")[0].isdigit():
          shutil.rmtree(entry, ignore_errors=True)

  def save(self, step: int, tree: dict, data: ocp.args.CheckpointArgs | None = None) -> None:
    """Starts an asynchronous save; arrays are copied off the live state before it returns.

    `data`: the run's data iterator state to save with it as item `DATA`, in the orbax arguments of the
    handler registered for it (`register_item`), fixed: the handler may read it after this returns.

    Their digests are computed here, before returning too: once it returns, the
    caller may donate or overwrite the arrays while orbax writes its copies.
    Raises `CheckpointSaveError` for this step, or for the save before it if that one failed.
    """
    self.wait()
    self._saving = step
    items = {ITEM: ocp.args.PyTreeSave(tree, save_args=_layer_chunks(tree))}
    if self.digests:
      items[DIGESTS] = ocp.args.JsonSave(tree_digests(tree))
    if data is not None:
      items[DATA] = data
    try:
      self.manager.save(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax and tensorstore report a failed write in several types
      raise self._save_error(e) from e

  def wait(self) -> None:
    """Waits for the save in flight; raises `CheckpointSaveError` if it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._save_error(e) from e
    self._saving = None

  def close(self) -> CheckpointSaveError | None:
    """Finishes the save in flight and releases orbax's threads. Never raises: returns the save's error."""
    error = None
    try:
      self.wait()
    except CheckpointSaveError as e:
      error = e
    try:
      self.manager.close()
    except Exception as e:
      error = error or self._save_error(e)
    if error is not None:
      self.remove_temporaries()
    return error

  def _save_error(self, e: Exception) -> CheckpointSaveError:
    step, self._saving = self._saving, None
    reason = " ".join(str(e).split())
    reason = reason if len(reason) <= 300 else reason[:300] + "..."
    what = f"checkpoint step {step}" if step is not None else "a checkpoint"
    return CheckpointSaveError(f"could not save {what} in {self.directory}: {type(e).__name__}: {reason}")

  def restore_data(self, step: int, item: ocp.args.CheckpointArgs) -> bool:
    """Restores the data state saved with `step` through `item` (the restoring counterpart of `save`'s `data`,
    which sets the run's iterator); False when the step has none."""
    if DATA not in saved_items(self.step_dir(step)):
      return False
    try:
      self.manager.restore(step, args=ocp.args.Composite(**{DATA: item}))
    except CheckpointError:  # the iterator's own refusal (another data config), as it said it
      raise
    except (OSError, ValueError, KeyError) as e:
      raise CheckpointError(
          f"{self.step_dir(step)}: its {DATA}/ iterator state cannot be read by this process ({type(e).__name__}: {e})"
      ) from e
    return True

  def restore(self, step: int, target: dict) -> dict:
    """Restores `step` into the abstract `target` tree, after checking every path and shape; then checks each
    array against the digest recorded when it was saved."""
    if step not in self.manager.all_steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {self.all_steps()}")
    problem = step_problem(self.step_dir(step))
    if problem is None:
      try:
        stored_tree = self.manager.item_metadata(step)[ITEM].tree
      except Exception as e:  # orbax raises many types for a damaged folder; all mean the same here
        problem = f"its metadata cannot be read ({type(e).__name__}: {e})"
    if problem is not None:
      raise CheckpointError(f"{self.step_dir(step)} is damaged: {problem}; {self._fallback(step)}")
    layout = _foreign_layout(stored_tree)
    stored = stored_paths(layouts.normalize(stored_tree, layout) if layout else stored_tree)
    wanted = stored_paths(target)
    where = f"checkpoint {os.path.join(self.directory, str(step))}"
    missing = sorted(set(wanted) - set(stored), key=_params_first)
    copies = canonical.older_mtp_norms(missing, stored) if layout is None else {}
    missing = [path for path in missing if path not in copies]
    unknown = sorted(
        (p for p in set(stored) - set(wanted) if p.split("/")[0] not in IGNORED_SUBTREES),
        key=_params_first,
    )
    if missing or unknown:
      lines = [f"  missing: {p} {tuple(wanted[p].shape)}" for p in missing[:20]]
      lines += [f"  unexpected: {p}" for p in unknown[:20]]
      raise CheckpointError(f"{where} does not match the model:\n" + "\n".join(lines))
    misshaped = [
        f"  {path} has shape {tuple(stored[copies.get(path, path)].shape)}, the model expects {tuple(want.shape)}"
        for path, want in sorted(wanted.items(), key=_params_first)
        if tuple(stored[copies.get(path, path)].shape) != tuple(want.shape)
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
    if copies:  # not on disk: filled in below
      on_disk = jax.tree_util.tree_map_with_path(
          lambda key, x: ocp.PLACEHOLDER if layouts.keypath_str(key) in copies else x, on_disk
      )
    try:
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
    except Exception as e:  # tensorstore reports missing or damaged data files in several types
      reason = " ".join(str(e).split())[:300]
      # Orbax's error names a file or a chunk at best: the arrays read one by one name the one at fault.
      culprit = first_damaged_array(self.step_dir(step))
      what = f"its data cannot be read ({type(e).__name__}: {reason})"
      if culprit is not None:
        what = f"the data of {culprit.array} cannot be read ({type(e).__name__}: {reason})"
      raise CheckpointError(f"{self.step_dir(step)} is damaged: {what}; {self._fallback(step)}") from e
    items = restored["items"]
    if copies:
      print(f"{where} predates the MTP modules' own final norms: each starts as decoder_norm", file=sys.stderr)
      flat = stored_paths(items)  # copies: a train step donates its buffers, each once
      items = jax.tree_util.tree_map_with_path(
          lambda key, x: flat[copies[layouts.keypath_str(key)]].copy() if layouts.keypath_str(key) in copies else x,
          items,
          is_leaf=lambda x: x is ocp.PLACEHOLDER,
      )
    self._check_digests(step, items, stored_tree)
    return layouts.normalize(items, layout) if layout else items

  def _check_digests(self, step: int, restored: Any, stored_tree: Any) -> None:
    """Raises a one-line `CheckpointError` for the first restored array unlike the one saved (see `digest`)."""
    recorded = read_digests(self.step_dir(step)) if self.digests else None
    if not recorded:
      return
    stored = stored_paths(stored_tree)
    for path, array in stored_paths(restored).items():
      expected = recorded.get(path)
      if expected is None or path not in stored or (isinstance(array, jax.Array) and not array.is_fully_addressable):
        continue
      host = in_stored_dtype(np.asarray(array), np.dtype(stored[path].dtype))
      if host is not None and digest(host) != expected:
        raise CheckpointError(
            f"{self.step_dir(step)} is damaged: {path} does not match the digest recorded when it was saved "
            f"(found {digest(host)}, recorded {expected}); {self._fallback(step)}"
        )


# --- any checkpoint, read array by array -------------------------------------------


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


# No chunk cache: each array is read once, and a cache would hold it a second time.
TENSORSTORE = ts.Context({"cache_pool": {"total_bytes_limit": 0}})


class CheckpointReader:
  """One checkpoint in any layout, read through normal paths (see `maxbridge.layouts`), one array at a time.

  Memory holds one array, not the checkpoint. Orbax's default store (one OCDBT
  database of zarr arrays, as MaxText saves too) is read with tensorstore
  directly, array by array or slice by slice (`open`): orbax restores whole
  trees, and restoring one leaf of a large tree through it re-plans the whole
  tree for every array. Other checkpoints are read through orbax's restore,
  one leaf at a time (PLACEHOLDER for the rest).

  params_only: `leaves` holds the parameters alone; the optimizer state and
  step are not mapped, so any optimizer's state (or one this package does not
  know) is no obstacle to reading a model.
  """

  def __init__(self, path: str | os.PathLike, *, params_only: bool = False):
    self.items, self.step = resolve(path)
    self._handler = ocp.PyTreeCheckpointHandler()
    try:
      self.tree = self._handler.metadata(epath.Path(self.items.absolute())).tree
    except Exception as e:  # orbax raises many types for a bad folder; all mean the same here
      reason = " ".join(str(e).split())[:300]
      raise CheckpointError(
          f"cannot read the checkpoint metadata in {self.items} (damaged?): {type(e).__name__}: {reason}"
          f"{intact_before(self.items)}"
      ) from e
    self.stored = layouts.flatten_tree(self.tree)
    try:
      self.layout = layouts.detect(self.stored)
      self._normal = layouts.normal_paths(self.stored, self.layout, params_only=params_only)
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
    self.digests = read_digests(self.items.parent) or {}  # none: nothing to check against
    # The items folder's own flags; orbax's metadata API does not report them.
    flags = json.loads((self.items / "_METADATA").read_bytes())
    self.zarr_driver = ("zarr3" if flags.get("use_zarr3") else "zarr") if flags.get("use_ocdbt") else None

  def stored_leaf(self, normal: str) -> Leaf:
    """Shape and dtype as stored (`leaves` gives the step as int32 whatever the layout stores)."""
    stored = self.stored[self._stored_path[normal]]
    return Leaf(tuple(stored.shape), np.dtype(stored.dtype))

  def name(self, normal: str) -> str:
    """The array's name in the checkpoint's store: orbax joins the tree keys with dots."""
    return self._stored_path[normal].replace("/", ".")

  def open(self, normal: str) -> ts.TensorStore | None:
    """The stored array as a tensorstore (index it to read a slice); None when orbax's store is not OCDBT."""
    if self.zarr_driver is None:
      return None
    kvstore = {"driver": "ocdbt", "base": f"file://{self.items.absolute()}/", "path": self.name(normal) + "/"}
    try:
      return ts.open({"driver": self.zarr_driver, "kvstore": kvstore}, open=True, context=TENSORSTORE).result()
    except Exception as e:  # tensorstore reports damaged data in several types
      raise self.damaged(self._stored_path[normal], e) from e

  def damaged(self, stored: str, e: Exception) -> DamagedArrayError:
    """The error for data of `stored` (a stored path) that cannot be read."""
    reason = " ".join(str(e).split())[:300]
    return DamagedArrayError(
        f"cannot read {stored} from {self.items} (its data is damaged or incomplete): {type(e).__name__}: "
        f"{reason}{intact_before(self.items)}",
        stored,
        f"cannot be decoded ({type(e).__name__})",
    )

  def check(self, normal: str, array: np.ndarray) -> None:
    """Raises `DamagedArrayError` when `array`, read whole in its stored dtype, is not what was saved at
    `normal` (its recorded digest); an array without one passes."""
    stored = self._stored_path[normal]
    expected = self.digests.get(stored)
    if expected is not None and (found := digest(array)) != expected:
      raise DamagedArrayError(
          f"{stored} in {self.items} does not match the digest recorded when it was saved (found {found}, "
          f"recorded {expected}): its data is damaged{intact_before(self.items)}",
          stored,
          "does not match the digest recorded when it was saved",
      )

  def recorded_digest(self, normal: str) -> str | None:
    """The digest recorded for the array at `normal` when it was saved, if any."""
    return self.digests.get(self._stored_path[normal])

  def read(self, normal: str) -> np.ndarray:
    """The array at a normal path, as a numpy array (the step as int32), checked against its digest."""
    stored = self._stored_path[normal]
    array = self._read_tensorstore(normal) if self.zarr_driver else self._restore(stored)
    want = self.leaves[normal]
    if array.shape != want.shape:
      raise CheckpointError(f"{stored} in {self.items} holds shape {array.shape}, but its metadata says {want.shape}")
    self.check(normal, array)
    self.reads += 1
    return array.astype(want.dtype, copy=False)

  def _read_tensorstore(self, normal: str) -> np.ndarray:
    array = self.open(normal)
    try:
      return np.asarray(array.read().result())
    except Exception as e:
      raise self.damaged(self._stored_path[normal], e) from e

  def _restore(self, stored: str) -> np.ndarray:
    item = jax.tree_util.tree_map_with_path(
        lambda key, _: 0 if layouts.keypath_str(key) == stored else ocp.PLACEHOLDER, self.tree
    )
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    try:
      restored = self._handler.restore(
          epath.Path(self.items.absolute()),
          args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args),
      )
      return np.asarray(layouts.flatten_tree(restored)[stored])
    except Exception as e:  # tensorstore reports damaged data in several types
      raise self.damaged(stored, e) from e


def first_damaged_array(path: str | os.PathLike) -> DamagedArrayError | None:
  """The error of the first array of a checkpoint that cannot be read or is not what was saved; None if none.

  Reads one array at a time: for naming the array after a whole-tree restore failed.
  """
  try:
    reader = CheckpointReader(path)
  except CheckpointError:
    return None
  for normal in reader.leaves:
    try:
      reader.read(normal)
    except DamagedArrayError as e:
      return e
  return None


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  """Where `load_params` read from, and what it found there."""

  items: Path
  step: int | None
  layout: layouts.Layout
  config: Config | None  # the run's config.yml, when the checkpoint has one


_PARAMS = "params/params/"  # where a train state's parameters lie, as normal paths


def stored_params(path: str | os.PathLike) -> dict:
  """The canonical parameter tree of a checkpoint (see `load_params`) as `jax.ShapeDtypeStruct`s, from its
  metadata alone: enough to check a model against it before reading any array."""
  reader = CheckpointReader(path, params_only=True)
  flat = {p[len(_PARAMS) :]: reader.stored_leaf(p) for p in reader.leaves if p.startswith(_PARAMS)}
  return canonical.unflatten({p: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for p, leaf in flat.items()})


def load_params(path: str | os.PathLike, *, dtype: Any = None) -> tuple[dict, CheckpointInfo]:
  """The canonical parameter tree of any checkpoint this package reads, as numpy arrays.

  `path`: a run, checkpoints, step or items directory (the latest step is
  taken) in any layout: ours, MaxText's Linen or NNX checkpoints, params-only
  decode checkpoints. The tree is as stored, scanned or not; give it to
  `Model.load_params` (which stacks or unstacks it to fit the model). Reads
  parameters only, one array at a time; the optimizer state is not even parsed.
  """
  reader = CheckpointReader(path, params_only=True)
  tree = canonical.unflatten({p[len(_PARAMS) :]: reader.read(p) for p in reader.leaves if p.startswith(_PARAMS)})
  if dtype is not None:
    tree = layouts.cast_floating(tree, dtype)
  config_file = find_config(reader.items)
  config = load_config(str(config_file)) if config_file else None
  return tree, CheckpointInfo(reader.items, reader.step, reader.layout, config)
