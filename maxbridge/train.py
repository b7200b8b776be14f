"""The training loop: one loop for every flag combination.

A run directory `<base_output_directory>/<run_name>/` holds `config.yml`,
`metrics.jsonl` (one JSON object per step) and `checkpoints/<step>/`. Running
again with the same directory resumes from the latest checkpoint, whatever the
flags: both backends read and write the same checkpoint layout.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import logging
from tqdm import tqdm

from maxbridge import checkpointing, data, dispatch, sharding
from maxbridge.config import Config


class TrainingDiverged(FloatingPointError):
  pass


def run_directory(config: Config) -> Path:
  return Path(config.base_output_directory) / (config.run_name or config.model_name)


# Keys that change where and how often a run writes, never what a step computes.
_RUN_ONLY_KEYS = frozenset(
    {
        "run_name",
        "base_output_directory",
        "enable_checkpointing",
        "checkpoint_period",
        "max_to_keep",
        "eval_interval",
        "eval_steps",
        "log_period",
        "dataset_type",
        "dataset_path",
    }
)


def step_key(config: Config) -> tuple:
  """What a train step computes, from `config`: two configs with equal keys can share a trainer."""
  return tuple((k, v) for k, v in config.to_dict().items() if k not in _RUN_ONLY_KEYS)


def _check_trainer(trainer, config: Config) -> None:
  ours, theirs = dict(step_key(config)), dict(step_key(trainer.config))
  differ = [f"{k} (trainer: {theirs.get(k)!r}, run: {ours.get(k)!r})" for k in sorted(ours) if ours[k] != theirs.get(k)]
  if differ:
    raise ValueError(f"trainer= was built for another config; it differs in {', '.join(differ)}")


def global_batch_size(config: Config) -> int:
  """Rows per step: per device, times devices, times micro-batches (as MaxText)."""
  return config.per_device_batch_size * jax.device_count() * config.gradient_accumulation_steps


class MetricsLog:
  """metrics.jsonl, one object per step; on resume, lines past the checkpoint are dropped."""

  def __init__(self, path: Path, resume_step: int):
    self.path = path
    kept = []
    if path.exists():
      kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < resume_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)

  def append(self, record: dict) -> None:
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")


def train(config: Config, *, trainer=None, until_step: int | None = None, progress: bool = True) -> list[dict]:
  """Trains `config` in its run directory (resuming if it holds checkpoints); returns this call's metrics.

  `until_step` stops this call early (with a checkpoint) without changing the
  run: the schedule still spans `config.steps`, so a later call continues it.
  `trainer` (from `dispatch.create_trainer`, for a config with the same
  `step_key`) brings its own loss and hooks, and its compiled steps: pass the
  same one to several calls in a process (a resume, a flag flip back) to
  compile once.
  """
  end = config.steps if until_step is None else min(until_step, config.steps)
  if trainer is not None:
    _check_trainer(trainer, config)
  sharding.initialize_distributed(config)
  # Every process trains and checkpoints (orbax saves collectively); one writes the logs.
  primary = jax.process_index() == 0
  run_dir = run_directory(config)
  run_dir.mkdir(parents=True, exist_ok=True)
  if primary:
    config.to_yaml(run_dir / "config.yml")
  if trainer is None:
    trainer = dispatch.create_trainer(config)
  train_data = data.make_dataset(config, "train", global_batch_size(config))
  eval_data = data.make_dataset(config, "eval", global_batch_size(config)) if config.eval_interval else None
  ckpt = (
      checkpointing.Checkpointer(run_dir / "checkpoints", max_to_keep=config.max_to_keep)
      if config.enable_checkpointing
      else None
  )
  start = (ckpt.latest_step() if ckpt else None) or 0
  if start:
    state = trainer.from_checkpoint(ckpt.restore(start, trainer.checkpoint_target()))
    logging.info("resumed %s from step %d", run_dir, start)
  else:
    state = trainer.init_state(config.seed)
  log = MetricsLog(run_dir / "metrics.jsonl", resume_step=start) if primary else None
  last_saved = start if start else None
  records = []
  bar = tqdm(
      range(start, end),
      initial=start,
      total=config.steps,
      desc=run_dir.name,
      unit="step",
      disable=not (progress and primary),
  )
  try:
    for step in bar:
      batch = trainer.shard_batch(train_data.batch(step, jax.process_index(), jax.process_count()))
      began = time.perf_counter()
      state, metrics = trainer.train_step(state, batch)
      metrics = jax.device_get(metrics)  # also waits for the step: the timing below is real
      seconds = time.perf_counter() - began
      loss = float(metrics["loss"])
      if not math.isfinite(loss):
        where = f"step {last_saved} in {ckpt.directory}" if last_saved else "none was saved"
        raise TrainingDiverged(f"loss is {loss} at step {step}; training stopped. The last good checkpoint: {where}")
      record = {
          "step": step,
          "loss": loss,
          "lr": float(metrics["lr"]),
          "grad_norm": float(metrics["grad_norm"]),
          "tokens_per_s": float(metrics["tokens"]) / seconds,
      }
      if "maxima" in metrics:  # QK-Clip: the largest attention logit over layers and heads, before clipping
        record["max_logits"] = float(metrics["maxima"]["max_logits"].max())
      done = step + 1
      if eval_data is not None and (done % config.eval_interval == 0 or done == config.steps):
        record["eval_loss"] = evaluate(trainer, state, eval_data, config.eval_steps)
      if log:
        log.append(record)
      records.append(record)
      bar.set_postfix(loss=f"{loss:.3f}")
      if done % config.log_period == 0 and not bar.disable:
        bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step"), sys.stderr)
      if ckpt and (done % config.checkpoint_period == 0 or done == end):
        tree = trainer.to_checkpoint(state)
        # A finite loss at this step says nothing of the update it made: check
        # the state itself, so the last checkpoint is always a good one.
        if not _all_finite(tree):
          raise TrainingDiverged(
              f"the state became non-finite at step {step}; training stopped. The last good "
              f"checkpoint: step {last_saved} in {ckpt.directory}"
          )
        ckpt.save(done, tree)
        last_saved = done
  finally:
    bar.close()
    if ckpt:
      ckpt.wait()
      ckpt.close()
  return records


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def evaluate(trainer, state, eval_data: data.Dataset, steps: int) -> float:
  """Token-weighted mean loss over the first `steps` eval batches."""
  total = tokens = 0.0
  for step in range(steps):
    batch = eval_data.batch(step, jax.process_index(), jax.process_count())
    metrics = jax.device_get(trainer.eval_step(state, trainer.shard_batch(batch)))
    total += float(metrics["loss"]) * float(metrics["tokens"])
    tokens += float(metrics["tokens"])
  return total / max(tokens, 1.0)
