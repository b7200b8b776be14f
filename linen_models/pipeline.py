"""Linen's wiring of the pipeline (`maxbridge.ops.pipeline`): a scanned stack's parameters, one layer as a function.

The stack keeps its canonical parameters (declared by the decoder's nn.scan);
here each layer runs as `layer_class(cfg).apply`, so the one schedule in ops
sees plain arrays.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxbridge.core import families
from maxbridge.core.config import Config
from maxbridge.ops import pipeline
from maxbridge.ops import remat


def run(
    layer_class: type[nn.Module],
    params,
    cfg: Config,
    plan: families.PipelinePlan,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The stack's layers (`params`, layer axis at param_scan_axis) over x: the first plan.layers pipelined, the rest scanned."""
  params = jax.tree.map(lambda a: jnp.moveaxis(a, cfg.param_scan_axis, 0), nn.meta.unbox(params))

  def layer_fn(layer_params, h, extras):
    return layer_class(cfg).apply({"params": layer_params}, h, *extras)

  if cfg.remat_policy != "none":
    layer_fn = jax.checkpoint(layer_fn, policy=remat.checkpoint_policy(cfg.remat_policy))
  head = jax.tree.map(lambda a: a[: plan.layers], params)
  x, values = pipeline.run(
      layer_fn,
      head,
      x,
      (positions, segment_ids),
      stages=plan.stages,
      microbatches=plan.microbatches,
      repeats=plan.repeats,
      remat_policy=cfg.remat_policy,
  )
  tail = jax.tree.map(lambda a: a[plan.layers :], params)
  if jax.tree.leaves(tail)[0].shape[0]:
    x, rest = jax.lax.scan(lambda h, p: layer_fn(p, h, (positions, segment_ids)), x, tail)
    values = {key: jnp.concatenate([values[key], rest[key]]) for key in values}
  return x, values
