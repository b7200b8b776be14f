"""GRPO in memory: `train_grpo`, the steps `maxbridge.train` runs in a run folder, with no folder. The rollouts,
the loss and the rewards are `maxbridge.training.posttrain.grpo`'s."""

from __future__ import annotations

import jax

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.training import recipe
from maxbridge.training.posttrain import grpo


def train_grpo(
    config: Config, *, trainer=None, params: dict | None = None, steps: int | None = None
) -> tuple[dict, list[dict]]:
  """GRPO in memory (no run folder), from `params` (canonical; default the seed's initialisation):
  (final canonical params, one record per step). `maxbridge.train` runs the same steps with checkpoints.

  Records hold loss, kl, clip_fraction, ratio, mean_reward, completion_length
  (with dynamic_sampling, sampled_batches and uninformative_groups) and the
  sampled completions; with num_iterations > 1, each batch trains that many
  steps. Prompts and sampling keys follow `config.seed` and the step only, so
  Linen and NNX sample, score and train identically.
  """
  if not config.use_grpo:
    raise ValueError("train_grpo needs use_grpo=true in the config")
  if trainer is None:
    trainer = recipe.create_trainer(config)
  rollouts = grpo.Rollouts(config, trainer)
  state = trainer.init_state(config.seed)
  if params is not None:
    start = canonical.conform(params, trainer.abstract_params, config.param_scan_axis)
    state = trainer.replace_params(state, start)
  trainer.hold_frozen(state)
  records = []
  for step in range(config.steps if steps is None else steps):
    batch, info = rollouts.batch(step, state)
    state, metrics = trainer.train_step(state, batch)
    metrics = jax.device_get(metrics)
    records.append({"step": step, **{key: float(metrics[key]) for key in ("loss", *trainer.loss.metric_keys)}, **info})
  return trainer.model_params(state), records
