"""A conversion as a list of small steps over normal paths, checked before any data moves.

A step reads one array and writes one (copy, cast, move the layer axis), reads
one stack and writes its layers (unstack), or reads the layers and writes their
stack (stack). Built from shapes and dtypes alone, so a request that cannot
work (a missing layer, a layer axis that does not fit) fails before anything
is read or written, with a message naming the path and shape at fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from converters.errors import ConversionError
from maxbridge.core import canonical
from maxbridge.core.checkpointing import Leaf


class PlanError(ConversionError):
  """A conversion that cannot be done; the message names the path or shape at fault."""


@dataclasses.dataclass(frozen=True)
class Step:
  """Read `inputs`, write `outputs` (normal paths, in order)."""

  op: str  # "copy" | "unstack" | "stack" | "moveaxis"
  inputs: tuple[str, ...]
  outputs: tuple[tuple[str, Leaf], ...]
  axis: int | None = None  # unstack: the layer axis of the input; stack, moveaxis: of the output
  source_axis: int | None = None  # moveaxis: the layer axis of the input

  def run(self, read: Callable[[str], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (path, array) for each output, holding at most one stack at a time."""
    if self.op == "stack":
      # Filled layer by layer: the stack and one layer in memory, never two stacks.
      ((path, leaf),) = self.outputs
      out = np.empty(leaf.shape, leaf.dtype)
      for i, name in enumerate(self.inputs):
        out[(slice(None),) * self.axis + (i,)] = read(name)
      yield path, out
      return
    (name,) = self.inputs
    array = read(name)
    if self.op == "unstack":
      for i, (path, leaf) in enumerate(self.outputs):
        yield path, np.asarray(array[(slice(None),) * self.axis + (i,)], leaf.dtype)  # a view, unless cast
      return
    if self.op == "moveaxis":
      array = np.moveaxis(array, self.source_axis, self.axis)
    ((path, leaf),) = self.outputs
    yield path, np.asarray(array, leaf.dtype, order="C")


def build(
    leaves: Mapping[str, Leaf],
    *,
    scanned: bool | None = None,
    axis: int = 1,
    source_axis: int | None = None,
    dtype: Any = None,
    params_only: bool = False,
    num_layers: Mapping[str, int] | None = None,
) -> list[Step]:
  """Steps turning `leaves` (normal paths of one checkpoint) into the requested form.

  scanned: stack (True) or unstack (False) the layers; None keeps them as they are.
  axis: the layer axis of stacked outputs, and of stacked inputs unless
    `source_axis` says otherwise (their axis is then moved to `axis`).
  dtype: floating-point arrays are cast to it; integers (step, counts) are kept.
  num_layers: {stack name: layers}, when known (from the run's config, see
    `maxbridge.core.canonical.layer_stacks`); every stack must have that many.
  """
  leaves = {p: l for p, l in leaves.items() if not params_only or p.startswith("params/")}
  source_axis = axis if source_axis is None else source_axis
  cast = (lambda leaf: leaf) if dtype is None else _caster(np.dtype(dtype))
  stacked = {p: l for p, l in leaves.items() if canonical.is_stacked(p)}
  layered: dict[str, dict[int, tuple[str, Leaf]]] = {}
  for path, leaf in leaves.items():
    if found := canonical.layer_of(path):
      layered.setdefault(found[0], {})[found[1]] = (path, leaf)
  if stacked and layered:
    raise PlanError(
        f"the checkpoint mixes scanned and unscanned layers ({next(iter(stacked))} and "
        f"{next(iter(layered))}); expected one or the other"
    )
  steps = [
      Step("copy", (p,), ((p, cast(l)),)) for p, l in leaves.items() if p not in stacked and not canonical.layer_of(p)
  ]
  steps += _from_stacks(stacked, scanned, axis, source_axis, cast, num_layers or {})
  steps += _from_layers(layered, scanned, axis, cast, num_layers or {})
  return sorted(steps, key=_order)


def _from_stacks(stacked, scanned, axis, source_axis, cast, num_layers) -> list[Step]:
  """Steps for scanned inputs: unstack them, move their layer axis, or copy them."""
  if scanned is not False and source_axis == axis:
    return [Step("copy", (p,), ((p, cast(l)),)) for p, l in stacked.items()]
  # Only now is the layer axis read, so it is only checked now.
  counts = _stack_counts(stacked, source_axis, num_layers)
  steps = []
  for path, leaf in stacked.items():
    layer = Leaf(without_axis(leaf.shape, source_axis), leaf.dtype)
    if scanned is False:
      count = counts[canonical.stack_name(path)]
      outputs = tuple((canonical.layer_path(path, i), cast(layer)) for i in range(count))
      steps.append(Step("unstack", (path,), outputs, axis=source_axis))
    else:
      moved = Leaf(_with(layer.shape, axis, leaf.shape[source_axis], path), leaf.dtype)
      steps.append(Step("moveaxis", (path,), ((path, cast(moved)),), axis, source_axis))
  return steps


def _from_layers(layered, scanned, axis, cast, num_layers) -> list[Step]:
  """Steps for unscanned inputs: stack each parameter's layers, or copy them."""
  if not scanned:
    return [Step("copy", (n,), ((n, cast(l)),)) for by_index in layered.values() for n, l in by_index.values()]
  counts = _layer_counts(layered, num_layers)
  steps = []
  for path, by_index in layered.items():
    count = counts[canonical.stack_name(path)]
    names = tuple(by_index[i][0] for i in range(count))
    layer = _same_layers(path, [by_index[i][1] for i in range(count)], names)
    stack = Leaf(_with(layer.shape, axis, count, path), layer.dtype)
    steps.append(Step("stack", names, ((path, cast(stack)),), axis))
  return steps


def _caster(dtype: np.dtype) -> Callable[[Leaf], Leaf]:
  def cast(leaf: Leaf) -> Leaf:
    return Leaf(leaf.shape, dtype) if np.issubdtype(leaf.dtype, np.floating) or leaf.dtype == dtype else leaf

  return cast


def _order(step: Step) -> tuple:
  return path_order(step.outputs[0][0])


def path_order(path: str) -> tuple:
  """Sort key: parameters first, then optimizer state, then the step; a stack's layers together."""
  group = 0 if path.startswith("params/") else 1 if path.startswith("opt_state/") else 2
  found = canonical.layer_of(path)
  return (group, found[0], found[1]) if found else (group, path, -1)


def without_axis(values: Sequence, axis: int) -> Sequence:
  """A shape (or chunk shape, or chunk index) without entry `axis`, as the same type."""
  return values[:axis] + values[axis + 1 :]


def _with(shape: tuple[int, ...], axis: int, count: int, path: str) -> tuple[int, ...]:
  if not 0 <= axis <= len(shape):
    raise PlanError(
        f"cannot put the layer axis of {path} (layer shape {shape}) at {axis}: valid axes are " f"0..{len(shape)}"
    )
  return shape[:axis] + (count,) + shape[axis:]


def _stack_counts(stacked: Mapping[str, Leaf], axis: int, num_layers: Mapping[str, int]) -> dict[str, int]:
  """{stack name: layers along `axis`}, the same for every array of a stack, or a PlanError saying why not."""
  counts = {}
  for name in sorted({canonical.stack_name(p) for p in stacked}):
    stack = {p: l for p, l in stacked.items() if canonical.stack_name(p) == name}
    sizes = {l.shape[axis] if axis < len(l.shape) else None for l in stack.values()}
    expected = num_layers.get(name)
    if len(sizes) == 1 and None not in sizes and expected in (None, *sizes):
      counts[name] = sizes.pop()
      continue
    fitting = [
        a
        for a in range(min(len(l.shape) for l in stack.values()))
        if len({l.shape[a] for l in stack.values()}) == 1 and expected in (None, next(iter(stack.values())).shape[a])
    ]
    lines = [f"  {p}: shape {l.shape}" for p, l in list(stack.items())[:6]]
    said = f"; the config says {expected} layers" if expected else ""
    found = sorted(n for n in sizes if n is not None)
    raise PlanError(
        f"param_scan_axis {axis} does not match the stacked {name}: along axis {axis} the arrays "
        f"have {found} layers{' or no such axis' if None in sizes else ''}{said}:\n"
        + "\n".join(lines)
        + (f"\naxes where every array agrees: {fitting}" if fitting else "\nno axis fits every array")
    )
  return counts


def _layer_counts(layered: Mapping[str, Mapping[int, Any]], num_layers: Mapping[str, int]) -> dict[str, int]:
  """{stack name: number of layers}: every array of a stack needs its layers_0 .. layers_{L-1}."""
  counts = {}
  for path, by_index in layered.items():
    name = canonical.stack_name(path)
    counts[name] = max(counts.get(name, 0), max(by_index) + 1)
  for name, count in counts.items():
    expected = num_layers.get(name)
    if expected is not None and count != expected:
      raise PlanError(f"the checkpoint has {name}_0..{name}_{count - 1}, but the config says {expected} layers")
  for path, by_index in layered.items():
    count = counts[canonical.stack_name(path)]
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
      raise PlanError(
          f"cannot stack {path}: layer(s) {missing} missing (no {canonical.layer_path(path, missing[0])}); "
          f"found layers {sorted(by_index)}, and stacking needs every layer 0..{count - 1}"
      )
  return counts


def _same_layers(path: str, leaves: list[Leaf], names: tuple[str, ...]) -> Leaf:
  for name, leaf in zip(names, leaves):
    if leaf != leaves[0]:
      raise PlanError(
          f"cannot stack {path}: {name} has shape {leaf.shape} {leaf.dtype}, but {names[0]} has "
          f"{leaves[0].shape} {leaves[0].dtype}; every layer must match"
      )
  return leaves[0]
