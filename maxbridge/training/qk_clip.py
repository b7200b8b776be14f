"""QK-Clip (MuonClip): rescale the query/key weights of heads whose attention logits grew too large.

After each optimizer update, every head h of every layer gets the scale
s = min(1, τ / max_logit_h), where max_logit_h is the largest pre-softmax
score that head produced in the step (over the batch and unmasked positions).
The scale is folded into the weights so that the head's logits shrink by s:

- grouped-query / multi-head attention: the query head's kernel (and bias) by
  s. Keys are shared by several query heads, so they cannot carry a per-head
  factor.
- MLA: the query's no-RoPE part and the key's no-RoPE part (`wkv_b`) by √s
  each, the query's RoPE part by s (its key part is shared across heads);
  values are left alone.

Per layer, also in scanned stacks: each layer is clipped by its own heads'
maxima (MaxText reduces over the stacked layer axis and clips every layer
alike; we do not). Heads at or under τ are left bit-identical (s is exactly 1).
Acts on canonical parameters, so it is written once for both backends; the
weights and pieces of each family are its registry entry's `qk_clip_targets`.
"""

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from maxbridge.core import canonical
from maxbridge.core.config import Config


def head_scales(max_logits: jax.Array, threshold: float) -> jax.Array:
  """[..., heads] maxima -> s = min(1, τ / max), exactly 1 where max <= τ."""
  max_logits = max_logits.astype(jnp.float32)
  return jnp.where(max_logits > threshold, threshold / jnp.maximum(max_logits, threshold), 1.0)


def _multiplier(shape, scales, head_axis: int, layer_axis: int | None, pieces) -> jax.Array:
  """A float32 array of `shape`: s ** power on each piece, 1 elsewhere.

  `scales` is [heads], or [layers, heads] with the layer axis of the leaf at `layer_axis`.
  """
  ndim = len(shape)
  if layer_axis is None:
    broadcast = [1] * ndim
    broadcast[head_axis] = shape[head_axis]
    scales = scales.reshape(broadcast)
  else:
    order = sorted([(layer_axis, 0), (head_axis, 1)])
    scales = jnp.transpose(scales, [source for _, source in order])
    broadcast = [1] * ndim
    broadcast[layer_axis], broadcast[head_axis] = shape[layer_axis], shape[head_axis]
    scales = scales.reshape(broadcast)
  multiplier = jnp.ones(shape, jnp.float32)
  for piece in pieces:
    index = [slice(None)] * ndim
    index[piece.feature_axis] = slice(piece.start, piece.stop)
    factor = scales if piece.power == 1.0 else jnp.sqrt(scales) if piece.power == 0.5 else scales**piece.power
    multiplier = multiplier.at[tuple(index)].multiply(factor)
  return multiplier


def clip(params: Mapping[str, Any], max_logits: Mapping[str, jax.Array], config: Config) -> dict:
  """Canonical params with each stack's heads rescaled; `max_logits[stack]` is [layers, heads].

  Works on scanned (`decoder/layers`, layer axis at `param_scan_axis`) and
  unscanned (`decoder/layers_i`) trees alike.
  """
  targets = config.family.qk_clip_targets(config)  # path under a layer -> (head axis, pieces)
  axis = config.param_scan_axis
  flat = canonical.flatten(params)
  for stack, count in canonical.layer_stacks(config):
    scales = head_scales(max_logits[stack], config.qk_clip_threshold)
    if scales.shape[0] != count:
      raise ValueError(f"max_logits[{stack!r}] has {scales.shape[0]} layers, the stack has {count}")
    for rest, (head_axis, pieces) in targets.items():
      scanned = f"decoder/{stack}/{rest}"
      if scanned in flat:
        # The layer axis sits at param_scan_axis; axes from there on move one right.
        shift = lambda a: a + (a >= axis)  # noqa: E731
        moved = [dataclasses.replace(p, feature_axis=shift(p.feature_axis)) for p in pieces]
        flat[scanned] = _apply(flat[scanned], scales, shift(head_axis), axis, moved)
        continue
      for i in range(count):
        path = f"decoder/{stack}_{i}/{rest}"
        if path not in flat:
          raise KeyError(f"QK-Clip: no parameter {path!r} (nor its scanned form {scanned!r})")
        flat[path] = _apply(flat[path], scales[i], head_axis, None, pieces)
  return canonical.unflatten(flat)


def _apply(leaf, scales, head_axis, layer_axis, pieces):
  multiplier = _multiplier(leaf.shape, scales, head_axis, layer_axis, pieces)
  return (leaf.astype(jnp.float32) * multiplier).astype(leaf.dtype)


def after_update(params: Mapping[str, Any], metrics: Mapping[str, Any], *, config: Config) -> dict:
  """The train step's after-update hook: clip by this step's per-layer maxima ([all layers, heads], depth order)."""
  maxima = metrics["maxima"]["max_logits"]
  per_stack, start = {}, 0
  for stack, count in canonical.layer_stacks(config):
    per_stack[stack] = maxima[start : start + count]
    start += count
  return clip(params, per_stack, config)
