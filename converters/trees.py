"""The converters for trees in memory (`load_params`, for checkpoints on disk, is `maxbridge.core.checkpointing`'s)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from maxbridge.core import canonical, checkpointing, layouts


def detect_layout(tree_or_metadata: Any) -> layouts.Layout:
  """The layout of a tree, of orbax metadata (`handler.metadata(dir).tree`), or of a checkpoint path.

  `Layout.describe()` says it in words, e.g. "nnx layout (pure dict of
  TrainStateNNX), unscanned, float32, with optimizer state".
  """
  if isinstance(tree_or_metadata, (str, os.PathLike)):
    return checkpointing.CheckpointReader(tree_or_metadata).layout
  return layouts.detect(_pure(tree_or_metadata))


def to_linen(tree: Any, *, scan_layers: bool | None = None, param_scan_axis: int = 1, dtype: Any = None) -> dict:
  """Any layout -> MaxText's Linen layout, the one maxbridge checkpoints use.

  `{"params": {"params": T}, "opt_state": [adam, None, schedule], "step": int32}`,
  or `{"params": {"params": T}}` for a tree without optimizer state. Leaves are
  the input's own arrays (not copied) unless `scan_layers` stacks (True) or
  unstacks (False) the layers on `param_scan_axis` (Adam's mu and nu with the
  parameters), or `dtype` casts the floating-point ones.
  """
  linen = layouts.normalize(_pure(tree))
  if "step" in linen:
    linen["step"] = linen["step"].astype(layouts.STEP_DTYPES[layouts.LINEN])
  if scan_layers is not None:
    change = canonical.stack_layers if scan_layers else canonical.unstack_layers
    linen = _each_parameter_tree(linen, lambda t: change(t, param_scan_axis))
  if dtype is not None:
    linen = layouts.cast_floating(linen, dtype)
  return linen


def to_nnx(tree: Any, *, scan_layers: bool | None = None, param_scan_axis: int = 1, dtype: Any = None) -> dict:
  """Any layout -> the NNX layout: `nnx.to_pure_dict(nnx.state(TrainStateNNX))`.

  `{"model": T, "optimizer": {"opt_state": {0: adam, 2: schedule}, "step": uint32}}`,
  or `{"model": T}` without optimizer state; options as in `to_linen`. The
  result fills a train state with `nnx.replace_by_pure_dict(nnx.state(state), tree)`.
  """
  linen = to_linen(tree, scan_layers=scan_layers, param_scan_axis=param_scan_axis, dtype=dtype)
  if "step" in linen:
    linen["step"] = linen["step"].astype(layouts.STEP_DTYPES[layouts.NNX])
  return layouts.linen_to_nnx(linen)


def _pure(tree: Any) -> Any:
  # An nnx.State holds Variables; its pure dict holds their arrays.
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _each_parameter_tree(node: Any, change: Callable[[dict], dict]) -> Any:
  """Applies `change` to every canonical tree under a {"params": T} level (params, Adam's mu and nu)."""
  if isinstance(node, Mapping):
    if set(node) == {"params"} and isinstance(node["params"], Mapping) and "decoder" in node["params"]:
      return {"params": change(node["params"])}
    return {k: _each_parameter_tree(v, change) for k, v in node.items()}
  if isinstance(node, list):
    return [_each_parameter_tree(v, change) for v in node]
  return node
