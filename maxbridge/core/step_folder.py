"""One checkpoint step's folder as stored: where it is, its items, whether it looks intact, and its digests.

`<dir>/<step>/` holds `items/` (the state, `ITEM`), `digests/` (`DIGESTS`: a digest of every array saved,
`digest`, committed with the step) and, for a run on a Grain pipeline, `data/`. `checkpointing` saves and reads
steps; this module finds a step (`resolve`) and is what its writer and readers check a step against.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash

from maxbridge.core import layouts

ITEM = "items"  # CheckpointManager's item name, as MaxText and maxbridge save
DIGESTS = "digests"  # the step's second item: {stored path: digest} of its arrays
DIGESTS_FILE = "digests.json"
DIGEST_ALGORITHM = "xxh3_64"


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or does not fit the model; the message names the step folder."""


class DamagedArrayError(CheckpointError):
  """An array whose data cannot be decoded or does not match its recorded digest.

  `array`: its stored path; `reason`: what is wrong with it, in a few words.
  """

  def __init__(self, message: str, array: str, reason: str):
    super().__init__(message)
    self.array = array
    self.reason = reason


def step_problem(step_dir: str | os.PathLike) -> str | None:
  """Why the step folder `step_dir` cannot be restored, or None when it looks intact.

  Reads only `items/_METADATA` (a small JSON file), so listing every step stays cheap.
  """
  meta = Path(step_dir) / ITEM / "_METADATA"
  if not (Path(step_dir) / ITEM).is_dir():
    return f"it has no {ITEM}/ folder (an empty or partly deleted step)"
  if not meta.is_file():
    return f"{ITEM}/_METADATA is missing"
  try:
    tree = json.loads(meta.read_bytes())
  except (ValueError, OSError) as e:
    return f"{ITEM}/_METADATA is not readable JSON ({type(e).__name__})"
  if not isinstance(tree, dict) or not isinstance(tree.get("tree_metadata"), dict):
    return f"{ITEM}/_METADATA holds no tree metadata"
  return None


def digest(array: np.ndarray) -> str:
  """The "xxh3_64:<hex>" of an array's dtype, shape and bytes in C order: a change in any of them changes it."""
  hasher = xxhash.xxh3_64(f"{array.dtype.name}{array.shape}".encode())
  # As bytes: ml_dtypes' bfloat16 has no buffer format for xxhash to take.
  hasher.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
  return f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}"


def tree_digests(tree: Any) -> dict[str, str]:
  """{stored path: digest} of a tree's arrays, as `save` records them.

  An array this process cannot see whole (sharded across hosts) gets none:
  its digest would need the other hosts' shards.
  """
  return {
      path: digest(np.asarray(leaf))
      for path, leaf in stored_paths(tree).items()
      if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable
  }


def read_digests(step_dir: str | os.PathLike) -> dict[str, str] | None:
  """The digests recorded with a step (`DIGESTS`), or None when it has none (MaxText's, older steps)."""
  file = Path(step_dir) / DIGESTS / DIGESTS_FILE
  if not file.is_file():
    if DIGESTS in saved_items(step_dir):  # the step says it was saved with them: they were removed since
      raise CheckpointError(f"{file} is missing, but {step_dir} was saved with digests: the step is damaged")
    return None
  try:
    found = json.loads(file.read_bytes())
  except (ValueError, OSError) as e:
    raise CheckpointError(f"{file} is not readable JSON ({type(e).__name__}): the step is damaged") from e
  if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
    raise CheckpointError(f"{file} does not map array paths to digests: the step is damaged")
  # Another algorithm's digests (a newer maxbridge) cannot be checked here; they are not a mismatch.
  return {path: value for path, value in found.items() if value.startswith(f"{DIGEST_ALGORITHM}:")}


def saved_items(step_dir: str | os.PathLike) -> set[str]:
  """The items orbax's step metadata says were saved in `step_dir` (none when it cannot tell)."""
  try:
    return set(json.loads((Path(step_dir) / "_CHECKPOINT_METADATA").read_bytes()).get("item_handlers") or ())
  except (OSError, ValueError, AttributeError):
    return set()


def in_stored_dtype(array: np.ndarray, stored: np.dtype) -> np.ndarray | None:
  """`array`, restored into another dtype, cast back to the one saved when that is exact; else None."""
  if array.dtype == stored:
    return array
  both_integers = np.issubdtype(array.dtype, np.integer) and np.issubdtype(stored, np.integer)
  return array.astype(stored) if both_integers or np.can_cast(stored, array.dtype, "safe") else None


def stored_paths(tree: Any) -> dict[str, Any]:
  """{stored path: leaf} of a tree, as `digests` and the path checks name them."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {layouts.keypath_str(path): leaf for path, leaf in leaves}


def resolve(path: str | os.PathLike) -> tuple[Path, int | None]:
  """(items directory, step) of a run, checkpoints, step or items directory; the latest step."""
  given = Path(path)
  if not given.exists():
    raise CheckpointError(f"{given}: no such file or directory")
  if not given.is_dir():
    raise CheckpointError(f"{given} is a file: give a run, checkpoints, step or items folder")
  if (given / "_METADATA").is_file():
    return given, _step_of(given.parent)
  if (given / ITEM).is_dir():
    return given / ITEM, _step_of(given)
  checkpoints = given / "checkpoints" if (given / "checkpoints").is_dir() else given
  found = sorted(int(d.name) for d in checkpoints.iterdir() if d.name.isdigit()) if checkpoints.is_dir() else []
  problems = {step: step_problem(checkpoints / str(step)) for step in found}
  steps = [step for step in found if problems[step] is None]
  damaged = [step for step in found if problems[step] is not None and (not steps or step > steps[-1])]
  if not steps:
    why = "".join(f"; {checkpoints / str(s)} is damaged: {problems[s]}" for s in damaged[-3:])
    raise CheckpointError(
        f"{given} is not a checkpoint: expected a run directory (holding checkpoints/<step>/items), "
        f"a checkpoints directory (holding <step>/items), a step directory (holding items/) or an "
        f"items directory (holding _METADATA){why}"
    )
  for step in damaged:
    print(
        f"maxbridge: skipped {checkpoints / str(step)} (damaged: {problems[step]}); reading step {steps[-1]}",
        file=sys.stderr,
    )
  return checkpoints / str(steps[-1]) / ITEM, steps[-1]


def intact_before(items: Path) -> str:
  """For an error about the step holding `items`: the latest intact step before it, if any."""
  step_dir = items.absolute().parent
  if not step_dir.name.isdigit():
    return ""
  earlier = sorted(
      (int(d.name) for d in step_dir.parent.iterdir() if d.name.isdigit() and int(d.name) < int(step_dir.name)),
      reverse=True,
  )
  intact = next((s for s in earlier if step_problem(step_dir.parent / str(s)) is None), None)
  return (
      f"; step {intact} is intact ({step_dir.parent / str(intact)})"
      if intact is not None
      else "; no earlier step is intact"
  )


def _step_of(step_dir: Path) -> int | None:
  return int(step_dir.name) if step_dir.name.isdigit() else None
