"""Multi-turn tool-use GRPO in memory, rollouts asynchronous with the learner: `train_agentic`.

The environments, the episodes through `mb.Engine`'s slots and their packing are
`maxbridge.training.posttrain.agentic`'s; the loss is GRPO's. A thread samples
step k's episodes with policy version max(0, k - off_policy_steps) (the policy
after that many updates) while the learner trains on step k - 1's batch, so the
staleness (learner version - rollout version) never passes off_policy_steps; 0
is synchronous (sample, then train). The versions are exactly those, however
fast either side runs, so a run is reproducible and Linen and NNX sample alike.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.training import recipe
from maxbridge.training.posttrain.agentic import Environment, Rollouts, policy_loss, rollout_engine


class _Versions:
  """The policy's published parameter versions; a rollout waits for the one it may use."""

  def __init__(self, keep: int):
    self.keep, self.params, self.failed = keep, {}, False
    self.ready = threading.Condition()

  def publish(self, version: int, params) -> None:
    with self.ready:
      self.params[version] = params
      for old in [v for v in self.params if v <= version - self.keep]:
        del self.params[old]
      self.ready.notify_all()

  def get(self, version: int):
    with self.ready:
      self.ready.wait_for(lambda: version in self.params or self.failed)
      if self.failed:
        raise RuntimeError("the learner stopped")
      return self.params[version]

  def stop(self) -> None:
    with self.ready:
      self.failed = True
      self.ready.notify_all()


def _copy(params):
  # The learner's next step donates its state: a rollout keeps arrays of its own.
  return jax.tree.map(jnp.copy, params)


def train_agentic(
    config: Config,
    make_env: Callable[[], Environment],
    *,
    trainer=None,
    engine=None,
    params=None,
    steps: int | None = None,
    progress: Callable[[dict], None] | None = None,
) -> tuple[dict, list[dict]]:
  """GRPO on multi-turn episodes, rollouts asynchronous with the learner (see the module docstring): (final
  canonical params, one record per step: loss, kl, clip_fraction, mean_reward, staleness, rollout_version,
  rollout_tokens_per_s, learner_tokens_per_s, elapsed_s, transcripts). `progress` is called with each record.

  `trainer` and `engine` (`agentic.rollout_engine`) may be reused across runs of one config: compiled once."""
  if not config.use_grpo:
    raise ValueError("train_agentic needs use_grpo=true in the config (its loss is GRPO's)")
  # GRPO's options that act on its built-in rollouts, not on these episodes: refused, not ignored.
  unused = [
      f"{key}={getattr(config, key)}"
      for key, default in (("num_iterations", 1), ("dynamic_sampling", False), ("overlong_buffer_length", 0))
      if getattr(config, key) != default
  ]
  if unused:
    raise ValueError(
        f"{', '.join(unused)}: multi-turn rollouts train each batch once, keep every group and shape no reward by "
        "length (off_policy_steps sets how old the sampling policy may be); leave them at their defaults"
    )

  if trainer is None:
    trainer = recipe.create_trainer(config, loss=policy_loss(config))
  state = trainer.init_state(config.seed)
  if params is not None:
    # A copy: the first step donates the state, and `params` stay the caller's.
    state = trainer.replace_params(
        state, _copy(canonical.conform(params, trainer.abstract_params, config.param_scan_axis))
    )
  trainer.hold_frozen(state)
  steps = config.steps if steps is None else steps
  lag = config.off_policy_steps
  versions = _Versions(keep=lag + 1)
  versions.publish(0, _copy(trainer.model_params(state)))
  rollouts = Rollouts(config, make_env, rollout_engine(config, versions.get(0)) if engine is None else engine)
  batches: queue.Queue = queue.Queue()

  def produce():
    try:
      for step in range(steps):
        version = max(0, step - lag)  # the bound, exactly: the same versions on every run, fast or slow
        batches.put((step, version, *rollouts.batch(step, versions.get(version))))
    except BaseException as e:  # noqa: BLE001 - the learner re-raises it
      batches.put(e)

  worker = threading.Thread(target=produce, name="agentic-rollouts", daemon=True)
  began = time.perf_counter()
  worker.start()
  records = []
  try:
    for step in range(steps):
      item = batches.get()
      if isinstance(item, BaseException):
        raise item
      _, version, rows, info = item
      staleness = step - version  # the learner has made `step` updates
      if not 0 <= staleness <= lag:
        raise AssertionError(f"step {step} trains on version {version}: staleness {staleness} > {lag}")
      rows = {key: value for key, value in rows.items() if key in trainer.loss.batch_keys}
      learn_began = time.perf_counter()
      state, metrics = trainer.train_step(state, rows)
      metrics = jax.device_get(metrics)
      learn_s = time.perf_counter() - learn_began
      versions.publish(step + 1, _copy(trainer.model_params(state)))
      record = {
          "step": step,
          **{key: float(metrics[key]) for key in ("loss", "kl", "clip_fraction")},
          "staleness": staleness,
          "rollout_version": version,
          "learner_tokens_per_s": float((rows["inputs_segmentation"] > 0).sum()) / learn_s,
          "elapsed_s": time.perf_counter() - began,
          **info,
      }
      records.append(record)
      if progress is not None:
        progress(record)
  finally:
    versions.stop()
    worker.join()
  return trainer.model_params(state), records
