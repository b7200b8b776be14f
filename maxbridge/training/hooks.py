"""A run's features as hooks of the one training loop (`maxbridge.train`); `recipe.create_hooks` picks them.

The loop trains on the batches of one source: the config's dataset (`Data`),
or GRPO's completions sampled from the policy as it trains (`Sampled`). Each
`Hook` is told when the run's state is ready, when the run first writes into
its folder, and what each step logged: DPO and GRPO hold the frozen starting
policy (`FrozenReference`), LoRA checks and records the base its adapters train
on (`LoraBase`), QK-Clip logs the largest attention logit (`MaxLogits`). What a
feature does inside a step is the trainer's: its policy, loss and after-update
hook.
"""

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax

from maxbridge.core.config import Config
from maxbridge.models import lora
from maxbridge.training import data
from maxbridge.training.posttrain import grpo
from maxbridge.training.trainer import Trainer


def global_batch_size(config: Config) -> int:
  """Rows per step: per device, times devices, times micro-batches (as MaxText)."""
  return config.per_device_batch_size * jax.device_count() * config.gradient_accumulation_steps


class Data:
  """The config's dataset: each step's rows of this process, and the held-out set (None without eval_interval)."""

  def __init__(self, config: Config):
    self.train = data.make_dataset(config, "train", global_batch_size(config))
    self.eval = data.make_dataset(config, "eval", global_batch_size(config)) if config.eval_interval else None

  def batch(self, step: int, state) -> tuple[dict, dict]:
    """(this process's rows of `step`, entries for the step's record)."""
    del state
    return self.train.batch(step, jax.process_index(), jax.process_count()), {}


class Sampled:
  """GRPO's batches: completions sampled from the policy as it trains (`grpo.Rollouts`); no held-out set."""

  eval = None

  def __init__(self, config: Config, trainer: Trainer):
    self.rollouts = grpo.Rollouts(config, trainer)

  def batch(self, step: int, state) -> tuple[dict, dict]:
    rows, info = self.rollouts.batch(step, state)
    return rows, {key: info[key] for key in ("mean_reward", "completion_length")}


@dataclasses.dataclass
class Run:
  """What a hook sees of a run once its state is built."""

  config: Config
  trainer: Trainer
  run_dir: Path
  state: Any
  resumed: bool
  initial: Callable[[], Any]  # builds the state the run started from again (a resumed run's start)


class Hook:
  """A feature's part in a run; each method does nothing unless a feature needs it to."""

  def start(self, run: Run) -> None:
    """Called once the state is built (restored or new), before anything in the run folder changes: a hook that
    raises stops the run with its folder as it was."""

  def open(self, run_dir: Path) -> None:
    """Called as the run first writes into its folder (its first step ran), on the primary process only."""

  def record(self, metrics: dict, record: dict) -> None:
    """Adds entries to a step's metrics.jsonl record, from the step's (host) metrics."""


class FrozenReference(Hook):
  """DPO's and GRPO's reference: the run's starting policy, rebuilt on resume (checkpoints hold the policy only)."""

  def start(self, run: Run) -> None:
    run.trainer.set_reference(run.initial() if run.resumed else run.state)


class LoraBase(Hook):
  """Refuses to resume on another base than the adapters trained on, and records it (`lora.REFERENCE_FILE`)."""

  def __init__(self):
    self.reference: dict | None = None

  def start(self, run: Run) -> None:
    self.reference = lora.base_reference(run.config, run.trainer.params(run.state))
    lora.check_base(run.run_dir, self.reference)

  def open(self, run_dir: Path) -> None:
    if not (run_dir / lora.REFERENCE_FILE).exists():
      lora.write_reference(run_dir, self.reference)


class MaxLogits(Hook):
  """QK-Clip: the largest attention logit over layers and heads, before clipping."""

  def record(self, metrics: dict, record: dict) -> None:
    if "maxima" in metrics:
      record["max_logits"] = float(metrics["maxima"]["max_logits"].max())
