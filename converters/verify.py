"""`maxbridge verify`: every array of a checkpoint, or of every step of a run, read and checked against the digests
recorded when it was saved (`maxbridge.core.checkpointing.digest`). No model is built; one array is held at a time."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from tqdm import tqdm

from converters.convert import PROGRESS_BYTES
from converters.source import Source
from maxbridge.core import checkpointing


@dataclasses.dataclass(frozen=True)
class StepCheck:
  """What `verify` found in one step: `damaged` names each array at fault, `problem` a step that cannot be read."""

  where: Path  # the step folder (the items folder when it is not in a step folder)
  arrays: int  # arrays read
  digested: int  # of which had a digest recorded
  damaged: list[checkpointing.DamagedArrayError]
  problem: str | None = None

  @property
  def ok(self) -> bool:
    return self.problem is None and not self.damaged

  def line(self) -> str:
    if self.problem is not None:
      return f"{self.where}: damaged: {self.problem}"
    if self.damaged:
      return f"{self.where}: damaged: " + "; ".join(f"{e.array} {e.reason}" for e in self.damaged)
    if not self.digested:
      return f"{self.where}: no digests recorded: {self.arrays} arrays read, nothing to check them against"
    unchecked = f"; {self.arrays - self.digested} have no digest recorded" if self.digested < self.arrays else ""
    return f"{self.where}: ok: {self.digested} arrays match their digests{unchecked}"


def steps_in(path: str | os.PathLike) -> list[Path]:
  """The items folders `verify` reads: each numbered step of a run or checkpoints folder (oldest first, damaged
  ones too), or the one step or items folder given."""
  given = Path(path)
  if not given.exists():
    raise checkpointing.CheckpointError(f"{given}: no such file or directory")
  if not given.is_dir():
    raise checkpointing.CheckpointError(f"{given} is a file: give a run, checkpoints, step or items folder")
  if (given / "_METADATA").is_file() or (given / checkpointing.ITEM).is_dir() or given.name == checkpointing.ITEM:
    return [given if (given / "_METADATA").is_file() or given.name == checkpointing.ITEM else given / checkpointing.ITEM]
  checkpoints = given / "checkpoints" if (given / "checkpoints").is_dir() else given
  steps = sorted((d for d in checkpoints.iterdir() if d.name.isdigit() and d.is_dir()), key=lambda d: int(d.name))
  if not steps:
    raise checkpointing.CheckpointError(
        f"{given} holds no checkpoint: expected a run directory (holding checkpoints/<step>/items), a checkpoints "
        "directory (holding <step>/items), a step directory (holding items/) or an items directory (holding _METADATA)"
    )
  return [step / checkpointing.ITEM for step in steps]


def verify(path: str | os.PathLike, *, progress: bool | None = None) -> list[StepCheck]:
  """Checks every array of the checkpoint(s) at `path` (see `steps_in`): decoded, and compared with its digest.

  A step that cannot be opened, an array that cannot be decoded and one unlike its digest are each reported,
  not raised, so that every step of a run gets its line. `progress`: a bar of bytes read (default: when the
  checkpoints hold at least `PROGRESS_BYTES`).
  """
  opened = [_open(items) for items in steps_in(path)]
  nbytes = sum(
      sum(leaf.nbytes for leaf in r.leaves.values()) for r in opened if isinstance(r, checkpointing.CheckpointReader)
  )
  show = progress if progress is not None else nbytes >= PROGRESS_BYTES
  checks = []
  with tqdm(
      total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not show, file=sys.stderr, desc="verify"
  ) as bar:
    for reader in opened:
      checks.append(reader if isinstance(reader, StepCheck) else _check(reader, bar))
  return checks


def _where(items: Path) -> Path:
  return items.parent if items.name == checkpointing.ITEM else items


def _open(items: Path) -> checkpointing.CheckpointReader | StepCheck:
  step_dir = _where(items)
  problem = checkpointing.step_problem(step_dir) if items.name == checkpointing.ITEM else None
  if problem is None:
    try:
      return checkpointing.CheckpointReader(items)
    except checkpointing.CheckpointError as e:
      problem = str(e)
  return StepCheck(step_dir, 0, 0, [], problem)


def _check(reader: checkpointing.CheckpointReader, bar: tqdm) -> StepCheck:
  source, damaged = Source(reader), []
  for normal, leaf in reader.leaves.items():
    try:
      source.read_array(normal)  # checks the digest
    except checkpointing.DamagedArrayError as e:
      damaged.append(e)
    bar.update(leaf.nbytes)
  digested = sum(reader.recorded_digest(n) is not None for n in reader.leaves)
  return StepCheck(_where(reader.items), len(reader.leaves), digested, damaged)
