"""Pipeline parallelism: one layer stack split into stages, micro-batches flowing through them.

One schedule, written once as a pure function over (the stack's weights, state
buffers); each backend only supplies `layer_fn`, one layer as a function of its
parameters. The weights stay in the canonical layout, stacked on a leading
layer axis [L, ...] (`canonical`), and are viewed here as [repeats, stages,
layers_per_stage, ...]: layer (r * stages + s) * layers_per_stage + j is the
j-th layer of stage s in repeat r. Sharding the canonical layer axis over the
"stage" mesh axis therefore gives each device its own stage's layers (for
repeats = 1; a circular pipeline's layers are re-laid out at the call).

The schedule, GPipe for repeats = 1 and circular for repeats > 1: at iteration
t, stage s works on item k = t - s, micro-batch k % M in repeat k // M, when
0 <= k < M * R. Stage s takes what stage s - 1 made the iteration before (a
roll over the stage axis, which GSPMD turns into a collective permute when the
stage axis is sharded); stage 0 takes micro-batch t % M from the micro-batch
buffer, and the last stage writes its result back there. A circular pipeline
needs M >= stages so that a micro-batch's last stage (written at the end of
t = k + S - 1) precedes its next repeat's first stage (read at t = k + M).
Iterations: M * R + S - 1, of which S - 1 per stage are idle (the bubble).
"""

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from maxbridge.core import sharding
from maxbridge.ops import remat

# layer_fn(one layer's params, x [b, ...], per-example inputs [b, ...]) -> (x, per-layer values).
LayerFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Mapping[str, jax.Array]]]

# How a per-layer value computed on each micro-batch becomes the value of the
# whole batch: attention's maxima are maxima over the batch; the MoE
# load-balancing loss is averaged (exact only when routing is linear in the
# batch, which MaxText's pipeline accepts too).
COMBINE = {"max_logits": "max", "moe_lb_losses": "mean"}
# The logical axes of the stage buffer [stages, micro-batch, length, embed], and
# of the micro-batch buffer [micro-batches, micro-batch, length, embed].
_ACTIVATION_AXES = ("activation_stage", "activation_batch", "activation_length", "activation_embed")
_BUFFER_AXES = ("num_activations", "activation_batch", "activation_length", "activation_embed")


def iterations(stages: int, microbatches: int, repeats: int = 1) -> int:
  return microbatches * repeats + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The fraction of stage-iterations that do no useful work: (S - 1) / (M * R + S - 1)."""
  return (stages - 1) / iterations(stages, microbatches, repeats)


def run(
    layer_fn: LayerFn,
    params: Any,
    x: jax.Array,
    extras: Any,
    *,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    remat_policy: str = "none",
    spmd_axis_name: str = "stage",
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Runs the stacked layers `params` (leaves [L, ...]) over x [B, ...] as a pipeline.

  `extras` (a tree of [B, ...] arrays, e.g. positions and segment ids) travel
  with their micro-batch. Returns x after all L layers and the per-layer values
  [L, ...], combined over micro-batches by `COMBINE`: the same as running the
  layers one after another on the whole batch.
  `remat_policy` (a `remat.POLICIES` name) rematerialises each stage's work
  per iteration, its weight lookup included, so an iteration keeps only its
  input for the backward pass, never a copy of the stage's weights.
  `spmd_axis_name` is the mesh axis the stage dimension is split over (what
  activation_stage maps to): constraints inside a stage keep it split there.
  """
  num_layers = jax.tree.leaves(params)[0].shape[0]
  per_stage, remainder = divmod(num_layers, stages * repeats)
  if remainder:
    raise ValueError(f"{num_layers} layers do not divide into stages={stages} x repeats={repeats}")
  batch = x.shape[0]
  if batch % microbatches:
    raise ValueError(f"batch {batch} does not divide into microbatches={microbatches}")
  if repeats > 1 and microbatches < stages:
    raise ValueError(f"a circular pipeline (repeats={repeats}) needs microbatches={microbatches} >= stages={stages}")
  total = microbatches * repeats

  # [L, ...] -> [stages, repeats, layers_per_stage, ...]: each stage's own weights first.
  def by_stage(leaf):
    return jnp.swapaxes(leaf.reshape(repeats, stages, per_stage, *leaf.shape[1:]), 0, 1)

  weights = jax.tree.map(by_stage, params)
  to_micro = lambda a: a.reshape(microbatches, batch // microbatches, *a.shape[1:])  # noqa: E731
  buffer = sharding.constrain(to_micro(x), _BUFFER_AXES[: x.ndim + 1])
  extras = jax.tree.map(to_micro, extras)

  def stage_fn(stage_weights, repeat, h, stage_extras):
    """One stage: its layers_per_stage layers of repeat `repeat`, one after another."""
    layers = jax.tree.map(lambda w: w[repeat], stage_weights)

    def body(h, layer):
      return layer_fn(layer, h, stage_extras)

    return jax.lax.scan(body, h, layers)

  if remat_policy != "none":
    stage_fn = jax.checkpoint(stage_fn, policy=remat.checkpoint_policy(remat_policy))
  stage_ids = jnp.arange(stages)

  def step(carry, t):
    buffer, shifted, values = carry
    item = t - stage_ids  # what each stage works on
    valid = (item >= 0) & (item < total)
    item = jnp.clip(item, 0, total - 1)
    micro, repeat = item % microbatches, item // microbatches
    # Stage s takes stage s - 1's output; stage 0 a micro-batch from the buffer.
    h = jnp.roll(shifted, 1, axis=0).at[0].set(buffer[t % microbatches])
    h = sharding.constrain(h, _ACTIVATION_AXES[: h.ndim])
    stage_extras = jax.tree.map(lambda e: e[micro], extras)
    out, per_layer = jax.vmap(stage_fn, spmd_axis_name=spmd_axis_name)(weights, repeat, h, stage_extras)
    # The last stage's finished item goes back into the buffer, for the next
    # repeat's first stage or as the result.
    last = t - (stages - 1)
    slot = jnp.clip(last, 0, total - 1) % microbatches
    kept = buffer[slot]
    buffer = buffer.at[slot].set(jnp.where(last >= 0, out[-1], kept))
    values = {key: _accumulate(key, values[key], v, valid, repeat) for key, v in per_layer.items()}
    return (buffer, out, values), None

  # One stage traced abstractly: the shapes of its per-layer values [layers_per_stage, ...].
  first = jax.tree.map(lambda w: w[0], weights)
  shapes = jax.eval_shape(stage_fn, first, 0, buffer[0], jax.tree.map(lambda e: e[0], extras))[1]
  values = {key: _initial(key, (stages, repeats, *s.shape), s.dtype) for key, s in shapes.items()}
  shifted = jnp.zeros((stages, *buffer.shape[1:]), x.dtype)
  (buffer, _, values), _ = jax.lax.scan(
      step, (buffer, shifted, values), jnp.arange(iterations(stages, microbatches, repeats))
  )
  x = buffer.reshape(x.shape)
  # [stages, repeats, layers_per_stage, ...] -> [L, ...] in depth order.
  values = {
      key: _finish(key, jnp.swapaxes(v, 0, 1).reshape(num_layers, *v.shape[3:]), microbatches)
      for key, v in values.items()
  }
  return x, values


def run_stack(
    layer_fn: LayerFn, layers: Any, x: jax.Array, extras: Any, *, pipelined: int, remat_policy: str = "none", **schedule
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """A whole stack (leaves [L, ...]) over x: its first `pipelined` layers through `run` (with `schedule`: stages,
  microbatches, repeats), the rest scanned after them (MaxText's pipeline_parallel_layers). Each backend's wiring
  calls this with its own layer_fn, so what runs where is decided here once."""
  if remat_policy != "none":
    layer_fn = jax.checkpoint(layer_fn, policy=remat.checkpoint_policy(remat_policy))
  head = jax.tree.map(lambda a: a[:pipelined], layers)
  x, values = run(layer_fn, head, x, extras, remat_policy=remat_policy, **schedule)
  tail = jax.tree.map(lambda a: a[pipelined:], layers)
  if jax.tree.leaves(tail)[0].shape[0]:
    x, rest = jax.lax.scan(lambda h, layer: layer_fn(layer, h, extras), x, tail)
    values = {key: jnp.concatenate([values[key], rest[key]]) for key in values}
  return x, values


def _combine(key: str) -> str:
  if key not in COMBINE:
    raise ValueError(f"per-layer value {key!r} has no rule to combine micro-batches; add it to pipeline.COMBINE")
  return COMBINE[key]


def _initial(key, shape, dtype):
  """The accumulator [stages, repeats, layers_per_stage, ...] of a per-layer value."""
  if _combine(key) == "max":
    return jnp.full(shape, -jnp.inf, dtype)
  return jnp.zeros(shape, dtype)


def _accumulate(key, acc, value, valid, repeat):
  stages = jnp.arange(acc.shape[0])
  current = acc[stages, repeat]
  mask = valid.reshape(-1, *([1] * (value.ndim - 1)))
  if _combine(key) == "max":
    new = jnp.where(mask, jnp.maximum(current, value), current)
  else:
    new = jnp.where(mask, current + value, current)
  return acc.at[stages, repeat].set(new)


def _finish(key, acc, microbatches):
  return acc / microbatches if _combine(key) == "mean" else acc
