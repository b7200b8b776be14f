"""`maxbridge compare`: two checkpoints in any layouts, normalised, then compared array by array."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import numpy as np

from converters import plan
from converters.errors import ConversionError
from converters.source import Source, same_bytes
from maxbridge.core import canonical, checkpointing
from maxbridge.core.config import ConfigError, load_config

MAX_LINES = 20


@dataclasses.dataclass(frozen=True)
class Difference:
  path: str  # a normal path (see maxbridge.core.layouts)
  what: str  # e.g. "max abs diff 0.5 (1 of 4096 elements)", "only in first"
  max_abs_diff: float | None = None


@dataclasses.dataclass(frozen=True)
class Comparison:
  """What `compare` found; `equal` is True when no path differs."""

  first: str
  second: str
  compared: int  # paths present in both
  differences: list[Difference]
  atol: float
  rtol: float
  metadata_only: bool

  @property
  def equal(self) -> bool:
    return not self.differences

  def report(self, max_lines: int = MAX_LINES) -> str:
    lines = [f"first:  {self.first}", f"second: {self.second}"]
    what = "shapes and dtypes" if self.metadata_only else f"values (atol={self.atol:g}, rtol={self.rtol:g})"
    if self.equal:
      lines.append(f"equal: {self.compared} arrays, same structure, {what}")
      return "\n".join(lines)
    lines += [f"  {d.path}: {d.what}" for d in self.differences[:max_lines]]
    if len(self.differences) > max_lines:
      lines.append(f"  ... and {len(self.differences) - max_lines} more")
    lines.append(f"different: {len(self.differences)} path(s) differ ({self.compared} arrays compared by {what})")
    return "\n".join(lines)


def compare(
    first: str | os.PathLike,
    second: str | os.PathLike,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    params_only: bool = False,
    metadata_only: bool = False,
) -> Comparison:
  """Compares two checkpoints after normalising layout, leaf wrappers and scanned vs unscanned.

  Values match when |a - b| <= atol + rtol * |b| elementwise (NaN matches NaN);
  a dtype or shape that differs is a difference. Arrays stored with the same
  bytes on both sides (a conversion that only renamed them) are compared as
  bytes, piece by piece, without decoding; the others are read one at a time
  (one layer stack at a time when only one side is scanned).
  """
  for name, value in (("atol", atol), ("rtol", rtol)):
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
      raise ConversionError(f"{name}={value!r} is invalid; it must be a finite number >= 0")
  readers = [checkpointing.CheckpointReader(first), checkpointing.CheckpointReader(second)]
  axes = [_scan_axis(r) for r in readers]
  # Compare in the form both can take without guessing: stacked only if both are.
  scanned = all(r.layout.scanned for r in readers)
  plans = [
      plan.build(r.leaves, scanned=scanned, axis=axes[0], source_axis=a, params_only=params_only)
      for r, a in zip(readers, axes)
  ]
  outputs = [{p: leaf for step in steps for p, leaf in step.outputs} for steps in plans]
  differences = [
      Difference(p, f"only in {side}")
      for side, mine, theirs in (("first", outputs[0], outputs[1]), ("second", outputs[1], outputs[0]))
      for p in sorted(set(mine) - set(theirs), key=plan.path_order)
  ]
  common = set(outputs[0]) & set(outputs[1])
  mismatched = {}
  for p in sorted(common, key=plan.path_order):
    a, b = outputs[0][p], outputs[1][p]
    if a.shape != b.shape:
      mismatched[p] = Difference(p, f"shape {a.shape} vs {b.shape}")
    elif a.dtype != b.dtype and metadata_only:
      mismatched[p] = Difference(p, f"dtype {a.dtype} vs {b.dtype}")
  if not metadata_only:
    mismatched.update(_compare_values(plans, readers, common - set(mismatched), outputs, atol, rtol))
  differences += [mismatched[p] for p in sorted(mismatched, key=plan.path_order)]
  return Comparison(
      first=_describe(readers[0]),
      second=_describe(readers[1]),
      compared=len(common),
      differences=differences,
      atol=atol,
      rtol=rtol,
      metadata_only=metadata_only,
  )


def _compare_values(plans, readers, paths, outputs, atol, rtol) -> dict[str, Difference]:
  # Stored alike on both sides (an array or a layer with the same chunk bytes): equal, nothing decoded.
  sources = [Source(r) for r in readers]
  views = [_views(steps) for steps in plans]
  paths = {
      p
      for p in paths
      if not (p in views[0] and p in views[1] and same_bytes(sources[0], views[0][p], sources[1], views[1][p]))
  }
  # The side with fewer, larger steps (stacks) drives; the other is read path by
  # path, each of its steps run once and its outputs kept until asked for.
  lead = 0 if len(plans[0]) <= len(plans[1]) else 1
  other = _Outputs(plans[1 - lead], sources[1 - lead].read_array, paths)
  found = {}
  for step in plans[lead]:
    if not any(path in paths for path, _ in step.outputs):
      continue
    for path, array in step.run(sources[lead].read_array):
      if path not in paths:
        continue
      pair = (array, other.pop(path)) if lead == 0 else (other.pop(path), array)
      difference = _difference(path, *pair, atol, rtol)
      del array, pair  # not held while the next step reads its arrays
      if difference:
        found[path] = difference
  return found


def _views(steps: list[plan.Step]) -> dict[str, tuple]:
  """{output path: `Source.view` arguments} for the outputs stored as such: an array, or a layer."""
  views = {}
  for step in steps:
    if step.op == "copy":
      views[step.outputs[0][0]] = (step.inputs[0],)
    elif step.op == "unstack":
      views.update((path, (step.inputs[0], step.axis, i)) for i, (path, _) in enumerate(step.outputs))
  return views


class _Outputs:
  """A plan's outputs on demand, for reading one side in the other side's order."""

  def __init__(self, steps: list[plan.Step], read: Callable[[str], np.ndarray], wanted: set[str]):
    self._step_of = {path: step for step in steps for path, _ in step.outputs}
    self._read = read
    self._wanted = wanted
    self._ready: dict[str, np.ndarray] = {}

  def pop(self, path: str) -> np.ndarray:
    if path not in self._ready:
      self._ready.update((p, a) for p, a in self._step_of[path].run(self._read) if p in self._wanted)
    return self._ready.pop(path)


def _difference(path: str, a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> Difference | None:
  if a.dtype == b.dtype and _equal(a, b):
    return None  # equal is within any tolerance; the common case, at a fraction of isclose's cost
  dtype_note = f"dtype {a.dtype} vs {b.dtype}; " if a.dtype != b.dtype else ""
  common = np.promote_types(a.dtype, b.dtype)
  if np.issubdtype(common, np.integer) and not np.issubdtype(common, np.signedinteger):
    common = np.dtype(np.int64)  # so that |a - b| of unsigned values does not wrap
  a, b = a.astype(common, copy=False), b.astype(common, copy=False)
  close = np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
  if close.all() and not dtype_note:
    return None
  bad = int(close.size - np.count_nonzero(close))
  diff = float(np.max(np.abs(a - b), initial=0.0)) if a.size else 0.0
  return Difference(path, f"{dtype_note}max abs diff {diff:.6g} ({bad} of {a.size} elements differ)", diff)


def _equal(a: np.ndarray, b: np.ndarray, block_bytes: int = 4 << 20) -> bool:
  """np.array_equal (NaN equal to NaN), a block of rows at a time: its temporaries (a few boolean arrays the
  size of its inputs) stay small beside arrays as large as the checkpoint's largest."""
  if a.ndim == 0 or a.shape != b.shape:
    return _equal_block(a, b)
  rows = max(1, block_bytes // max(1, a[0].nbytes))
  return all(_equal_block(a[i : i + rows], b[i : i + rows]) for i in range(0, len(a), rows))


def _equal_block(a: np.ndarray, b: np.ndarray) -> bool:
  # NaNs first only where a plain comparison fails: equal_nan costs several passes and copies.
  return np.array_equal(a, b) or (a.dtype.kind in "fc" and np.array_equal(a, b, equal_nan=True))


def _scan_axis(reader: checkpointing.CheckpointReader) -> int:
  """The layer axis of a scanned checkpoint: its config's, else the one axis on which every
  stack agrees on its layer count, else 1."""
  config_file = checkpointing.find_config(reader.items)
  if config_file:
    try:
      return load_config(str(config_file)).param_scan_axis
    except ConfigError:
      pass  # a config we cannot read says nothing about the axis; infer it
  stacks: dict[str, list[tuple[int, ...]]] = {}
  for path, leaf in reader.leaves.items():
    if path.startswith("params/") and canonical.is_stacked(path):
      stacks.setdefault(canonical.stack_name(path), []).append(leaf.shape)
  if not stacks:
    return 1
  agree = [
      a
      for a in range(min(len(s) for shapes in stacks.values() for s in shapes))
      if all(len({s[a] for s in shapes}) == 1 for shapes in stacks.values())
  ]
  return agree[0] if len(agree) == 1 else 1


def _describe(reader: checkpointing.CheckpointReader) -> str:
  step = f" (step {reader.step})" if reader.step is not None else ""
  return f"{reader.items}{step}: {reader.layout.describe()}"
