"""Muon (`opt_type: muon`): optax's `optax.contrib.muon`, told each canonical leaf's matrix by its logical axes.

Muon orthogonalises the momentum of each weight matrix (Newton-Schulz);
everything that is not a matrix of a linear map trains with AdamW inside the
same optax transformation. optax is told which axes of a leaf are the matrix
through `MuonDimensionNumbers(reduction_axis, output_axis)`; every other axis
is a batch axis, each slice its own matrix. We derive them from the logical
axis names every canonical leaf already carries, so one rule serves every
family and both layouts:

- the layer axis of a scanned stack (`layers`), the experts of an MoE layer
  (`exp`) and GPT-3's fused q/k/v (`qkv`) are batch axes: a scanned stack is
  exactly its unscanned layers, and each expert is its own matrix;
- the reduction (input) axis is a kernel's first other axis, and with it the
  head-dim axis when that first axis is the heads (the attention output
  projection reads heads x head_dim); the rest is the output (q/k/v: heads x
  head_dim; MLA's `wkv_b`: kv_heads x (nope + value));
- embeddings, the output head, norms' scales, biases, attention sinks, and
  (unless `muon_include_routers`) MoE routers train with AdamW, as MaxText's
  `muon_utils` decides.

The optimizer state is optax's own tree over the canonical parameters, so a
checkpoint holds it in the canonical layout on both backends.
"""

from typing import Any, Mapping, Sequence

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from maxbridge.core import canonical
from maxbridge.core.config import Config

BATCH_AXES = ("layers", "layers_outside_pipeline", "exp", "qkv")
HEAD_AXES = ("heads", "q_heads", "kv_heads")
# Path segments whose leaves are never matrices of a linear map in the step's sense (MaxText's exclusions).
ADAM_SEGMENTS = ("embedding", "logits_dense", "scale", "sinks")


def dimension_numbers(path: str, axes: Sequence[str | None], include_routers: bool = True) -> MuonDimensionNumbers | None:
  """The matrix of the canonical leaf at `path` with logical `axes`; None: it trains with AdamW."""
  segments = path.split("/")
  if any(segment.endswith("bias") for segment in segments) or any(
      excluded in segment for segment in segments for excluded in ADAM_SEGMENTS
  ):
    return None
  if not include_routers and segments[-2:] == ["gate", "kernel"]:
    return None
  matrix = [i for i, name in enumerate(axes) if name not in BATCH_AXES]
  if len(matrix) < 2:
    return None
  split = 2 if axes[matrix[0]] in HEAD_AXES else 1
  if len(matrix) <= split:
    raise ValueError(f"Muon: {path} with logical axes {tuple(axes)} has no output axis after its heads")
  return MuonDimensionNumbers(reduction_axis=tuple(matrix[:split]), output_axis=tuple(matrix[split:]))


def _canonical_path(keypath) -> str:
  # The optimizer sees {"params": tree} on Linen and the model's parameter State on NNX; the canonical path is
  # the dict keys below that, without Linen's collection level or a box's `.value`.
  keys = [str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey)]
  return "/".join(keys[1:] if keys[:1] == ["params"] else keys)


def dimension_numbers_fn(config: Config, axes: Mapping[str, Any]):
  """optax's `muon_weight_dimension_numbers` callable over the optimizer's parameter tree (either backend)."""
  flat_axes = canonical.flatten(axes)

  def leaf(keypath, _):
    path = _canonical_path(keypath)
    if path not in flat_axes:
      raise KeyError(f"Muon: no logical axes for parameter {path!r}; the trained tree has {sorted(flat_axes)[:8]}...")
    return dimension_numbers(path, flat_axes[path], config.muon_include_routers)

  return lambda params: jax.tree_util.tree_map_with_path(leaf, params)


def muon(config: Config, learning_rate: optax.Schedule, axes: Mapping[str, Any]) -> optax.GradientTransformation:
  """optax.contrib.muon with MaxText's arguments (its `optimizers.get_optimizer`), matrices found by `axes`."""
  return optax.contrib.muon(
      learning_rate,
      eps=config.adam_eps,
      beta=config.muon_beta,
      weight_decay=config.muon_weight_decay,
      muon_weight_dimension_numbers=dimension_numbers_fn(config, axes),
      consistent_rms=config.muon_consistent_rms or None,  # 0 is MaxText's null: width scaling
      adam_b1=config.adam_b1,
      adam_b2=config.adam_b2,
      adam_weight_decay=config.adam_weight_decay,
  )
