"""Pipeline parallelism's plan (MaxText's keys): which layers a pipeline runs, in how many stages and repeats.

Read by the config's checks (`config_rules`), the canonical tree (`canonical`), each backend's decoder and
`maxbridge.ops.pipeline`'s schedule. It asks the config's family entry for its stacks (`Family.layer_stacks`);
pure Python, no jax, like the config that validates against it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# A `maxbridge.core.config.Config`: its checks (`config_rules`) read the plan, so this module cannot import it.
Config = Any


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """Which layers a pipeline runs and how: the first `layers` entries of stack `stack`.

  `layers` = stages x repeats x per_stage; the stack's other entries (and every
  other stack, DeepSeek's dense layers) run outside the pipeline, as scanned layers.
  """

  stack: str
  layers: int
  stages: int
  per_stage: int
  repeats: int
  microbatches: int


def pipeline_stack(config: Config) -> tuple[str, int]:
  """(name, depth) of the stack a pipeline splits: the deepest stack, the later one on a tie (DeepSeek's MoE layers)."""
  return max(reversed(config.family.layer_stacks(config)), key=lambda stack: stack[1])


def pipeline_plan(config: Config) -> PipelinePlan | None:
  """The config's pipeline (MaxText's keys, -1 meaning "derived"), or None without one (ici_pipeline_parallelism=1).

  Raises ValueError naming the keys when the layers or micro-batches do not divide.
  """
  if config.ici_pipeline_parallelism == -1:
    raise ValueError("ici_pipeline_parallelism=-1: a pipeline needs its number of stages set, not the remaining devices")
  stages = config.ici_pipeline_parallelism * config.dcn_pipeline_parallelism
  if stages == 1:
    return None
  stack, depth = pipeline_stack(config)
  layers = depth if config.pipeline_parallel_layers == -1 else config.pipeline_parallel_layers
  per_stage = config.num_layers_per_pipeline_stage
  where = f"stack {stack!r} of decoder_block={config.decoder_block!r} has {depth} layers"
  if not 0 < layers <= depth:
    raise ValueError(
        f"pipeline_parallel_layers={config.pipeline_parallel_layers} must be -1 (all) or in 1..{depth}: {where}"
    )
  if layers % (stages * per_stage):
    raise ValueError(
        f"pipeline_parallel_layers={layers} ({where}) must be a multiple of the stages {stages} "
        f"(ici_pipeline_parallelism x dcn_pipeline_parallelism) x "
        f"num_layers_per_pipeline_stage={per_stage}; change them, or pipeline fewer layers with pipeline_parallel_layers"
    )
  repeats = layers // (stages * per_stage)
  if config.num_pipeline_repeats not in (-1, repeats):
    raise ValueError(
        f"num_pipeline_repeats={config.num_pipeline_repeats} must be -1 or pipeline_parallel_layers={layers} / "
        f"(stages={stages} x num_layers_per_pipeline_stage={per_stage}) = {repeats}"
    )
  microbatches = stages if config.num_pipeline_microbatches == -1 else config.num_pipeline_microbatches
  if microbatches % stages:
    raise ValueError(
        f"num_pipeline_microbatches={microbatches} must be a multiple of the stages {stages} "
        "(ici_pipeline_parallelism x dcn_pipeline_parallelism) "
        "(or -1: one micro-batch per stage)"
    )
  return PipelinePlan(stack, layers, stages, per_stage, repeats, microbatches)
