"""The two trees, flat: every leaf of a Linen variables tree and of an NNX module's state by its path, and the
`Link`s a plan (`match`) makes between them, which `convert` applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx
from flax.linen import meta as linen_meta
from flax.nnx import variablelib


class MigrateError(ValueError):
  """A plan that cannot be applied, or trees that do not fit it; the message names every path at fault."""


def path_str(path: Sequence[Any]) -> str:
  return "/".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True)
class LinenLeaf:
  path: tuple  # (collection, *module names, leaf name)
  shape: tuple
  dtype: Any
  box: Any = None  # the Partitioned / LogicallyPartitioned box it came in, re-applied on the way back

  @property
  def collection(self) -> str:
    return self.path[0]


@dataclasses.dataclass(frozen=True)
class NNXLeaf:
  path: tuple  # attribute names and list indices
  shape: tuple
  dtype: Any
  var_type: type
  collection: str  # the Linen collection its type corresponds to


@dataclasses.dataclass(frozen=True)
class Link:
  """Linen leaves -> NNX leaves. `op`: same (one to one), stack (one Linen stack to NNX leaves per layer),
  split (one Linen leaf to several NNX leaves), concat (several Linen leaves to one NNX leaf); `axis` for the
  last three. `transpose`/`reshape` apply (in that order) to a one-to-one link, Linen -> NNX."""

  linen: tuple[tuple, ...]
  nnx: tuple[tuple, ...]
  op: str = "same"
  axis: int = 0
  transpose: tuple[int, ...] | None = None
  reshape: tuple[int, ...] | None = None
  rule: str | None = None  # the user rule that made it

  @property
  def transformed(self) -> bool:
    return self.op != "same" or self.transpose is not None or self.reshape is not None

  def describe(self) -> str:
    lin = ", ".join(path_str(p) for p in self.linen)
    if self.op == "stack":
      target = f"{path_str(self.nnx[0])} .. {path_str(self.nnx[-1])} (stack axis {self.axis}, {len(self.nnx)} layers)"
    else:
      target = ", ".join(path_str(p) for p in self.nnx)
    how = []
    if self.op in ("split", "concat"):
      how.append(f"{self.op} axis {self.axis}")
    if self.transpose is not None:
      how.append(f"transpose {list(self.transpose)}")
    if self.reshape is not None:
      how.append(f"reshape {list(self.reshape)}")
    if self.rule:
      how.append(f"rule {self.rule!r}")
    return f"{lin} -> {target}" + (f"  [{'; '.join(how)}]" if how else "")


def shape_of(x) -> tuple:
  return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


def linen_leaves(variables: Mapping[str, Any]) -> dict[tuple, LinenLeaf]:
  """Every leaf of a Linen variables tree by its path, boxes (Partitioned, ...) opened."""
  out = {}

  def walk(node, path):
    if isinstance(node, linen_meta.AxisMetadata):
      value = node.unbox()
      out[path] = LinenLeaf(path, shape_of(value), getattr(value, "dtype", None), node)
    elif isinstance(node, Mapping):
      for key, child in node.items():
        walk(child, path + (str(key),))
    else:
      out[path] = LinenLeaf(path, shape_of(node), getattr(node, "dtype", None))

  if not isinstance(variables, Mapping):
    raise MigrateError(
        f"Linen variables must be a mapping of collections (e.g. {{'params': ...}}), got {type(variables)}"
    )
  walk(variables, ())
  return out


def collection_of(var_type: type) -> str | None:
  """The Linen collection of an NNX Variable type (flax's own registry); None for an unregistered type."""
  try:
    return variablelib.variable_name_from_type(var_type)
  except ValueError:
    return None


def nnx_leaves(state: nnx.State) -> dict[tuple, tuple[type, Any]]:
  return {tuple(path): (type(var), var.get_value()) for path, var in nnx.to_flat_state(state)}
