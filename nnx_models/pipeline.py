"""NNX's wiring of the pipeline (`maxbridge.ops.pipeline`): a scanned stack split into state, one layer as a function.

The stack keeps its canonical state (made by the decoder's nnx.vmap); here it
is split into plain arrays and each layer runs as nnx.merge of one layer's
slice, so the one schedule in ops sees plain arrays (jax.vmap over the stages,
lax.scan over the iterations).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import pipeline_plan
from maxbridge.core.config import Config
from maxbridge.ops import pipeline


def run(
    stack: nnx.Module,
    config: Config,
    plan: pipeline_plan.PipelinePlan,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The stack's layers over x: the first plan.layers pipelined, the rest scanned; the stack's state is left as it was."""
  graphdef, params, state = nnx.split(stack, nnx.Param, ...)
  # Parameters are stacked on param_scan_axis, other state on axis 0.
  params = jax.tree.map(lambda a: jnp.moveaxis(a, config.param_scan_axis, 0), params)

  def layer_fn(layer, h, extras):
    # A fresh module inside this trace; what it writes (a sown value) is dropped.
    return nnx.merge(graphdef, *layer)(h, *extras)

  return pipeline.run_stack(
      layer_fn,
      (params, state),
      x,
      (positions, segment_ids),
      pipelined=plan.layers,
      stages=plan.stages,
      microbatches=plan.microbatches,
      repeats=plan.repeats,
      remat_policy=config.remat_policy,
  )
