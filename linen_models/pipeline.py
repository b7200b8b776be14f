"""Linen's wiring of the pipeline (`maxbridge.ops.pipeline`): a scanned stack's parameters, one layer as a function.

The stack keeps its canonical parameters (declared by the decoder's nn.scan);
here each layer runs as `layer_class(cfg).apply`, so the one schedule in ops
sees plain arrays.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxbridge.core import pipeline_plan
from maxbridge.core.config import Config
from maxbridge.ops import pipeline


def run(
    layer_class: type[nn.Module],
    params,
    config: Config,
    plan: pipeline_plan.PipelinePlan,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The stack's layers (`params`, layer axis at param_scan_axis) over x: the first plan.layers pipelined, the rest scanned."""
  params = jax.tree.map(lambda a: jnp.moveaxis(a, config.param_scan_axis, 0), nn.meta.unbox(params))

  def layer_fn(layer_params, h, extras):
    return layer_class(config).apply({"params": layer_params}, h, *extras)

  return pipeline.run_stack(
      layer_fn,
      params,
      x,
      (positions, segment_ids),
      pipelined=plan.layers,
      stages=plan.stages,
      microbatches=plan.microbatches,
      repeats=plan.repeats,
      remat_policy=config.remat_policy,
  )
