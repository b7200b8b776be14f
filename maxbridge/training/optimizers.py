"""The optimizer (`opt_type`: AdamW, or Muon) with warmup + cosine schedule, built from config (MaxText's names and
layout)."""

from typing import Any, Mapping

import optax

from maxbridge.core.config import Config
from maxbridge.training import muon


def learning_rate_schedule(config: Config) -> optax.Schedule:
  """Linear warmup from 0 to learning_rate, then cosine down to final_fraction * learning_rate.

  Planned over `config.schedule_steps`, which may exceed `steps`: a run can stop early on a longer schedule.
  """
  warmup_steps = int(config.warmup_steps_fraction * config.schedule_steps)
  warmup = optax.linear_schedule(0.0, config.learning_rate, max(warmup_steps, 1))
  cosine = optax.cosine_decay_schedule(
      config.learning_rate,
      max(config.schedule_steps - warmup_steps, 1),
      alpha=config.cosine_learning_rate_final_fraction,
  )
  return optax.join_schedules([warmup, cosine], [warmup_steps])


def adamw(config: Config) -> optax.GradientTransformation:
  """optax.adamw: its state is (adam {count, mu, nu}, empty, schedule {count}), as MaxText saves it.

  Gradient clipping is applied before this transformation (see train_step),
  not chained into it, so the optimizer state keeps MaxText's on-disk layout.
  """
  return optax.adamw(
      learning_rate_schedule(config),
      b1=config.adam_b1,
      b2=config.adam_b2,
      eps=config.adam_eps,
      weight_decay=config.adam_weight_decay,
  )


def create(config: Config, axes: Mapping[str, Any]) -> optax.GradientTransformation:
  """The run's optimizer (`opt_type`) over a trained tree whose leaves have the logical `axes` (canonical)."""
  if config.opt_type == "muon":
    return muon.muon(config, learning_rate_schedule(config), axes)
  return adamw(config)
