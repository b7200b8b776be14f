"""A run's features as hooks of the one training loop (`maxbridge.train`); `recipe.create_hooks` picks them.

The loop trains on the batches of one source: the config's dataset (`Data`),
or GRPO's completions sampled from the policy as it trains (`Sampled`). Each
`Hook` is told when the run's state is ready, when the run first writes into
its folder, and what each step logged: DPO and GRPO hold the frozen starting
policy (`FrozenReference`), distillation checks and records its teacher
(`TeacherReference`), LoRA checks and records the base its adapters train on
(`LoraBase`), QK-Clip logs the largest attention logit (`MaxLogits`), and the
run keeps a copy of its tokenizer (`RunTokenizer`). What a feature does inside
a step is the trainer's: its policy, loss and after-update hook.
"""

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
from absl import logging

from maxbridge.core import canonical, checkpointing, files
from maxbridge.core.config import Config, ConfigError
from maxbridge.interop import pretrained
from maxbridge.interop.hf import folders
from maxbridge.models import lora
from maxbridge.training import data, data_paths, distill
from maxbridge.training.posttrain import grpo
from maxbridge.training.trainer import Trainer

# DPO's and GRPO's reference model, recorded as LoRA records its base (`lora.REFERENCE_FILE`).
REFERENCE_FILE = "reference.json"
# Distillation's teacher, recorded the same way.
TEACHER_FILE = "teacher.json"
# An in-memory dataset's files, with their fingerprints (`DataFiles`).
DATA_FILES = "data_files.json"


def global_batch_size(config: Config) -> int:
  """Rows per step: per device, times devices, times micro-batches (as MaxText)."""
  return config.per_device_batch_size * jax.device_count() * config.gradient_accumulation_steps


class Data:
  """The config's dataset: each step's rows of this process, and the held-out set (None without eval_interval)."""

  # What the run reads: fixed on resume (another value would go on from a step on other data), but with
  # restart_data_on_resume (the new data from its start).
  fixed_keys = data.DATA_KEYS
  # Every key it reads, and the train step never does.
  source_keys = (*fixed_keys, "sft_train_on_completion_only", "grain_worker_count", "grain_skip_damaged_records")

  def __init__(self, config: Config):
    config = data_config(config)  # without tokenizer_path, the text is tokenized as the model it starts from was
    # A Grain dataset reads only this process's share; the in-memory ones read all and slice each batch.
    where = (jax.process_index(), jax.process_count())
    self.restart = config.restart_data_on_resume
    self.train = data.make_dataset(config, "train", global_batch_size(config), *where)
    self.eval = data.make_dataset(config, "eval", global_batch_size(config), *where) if config.eval_interval else None
    # Distillation from offline logits: the teacher's top-k of each training batch, joined to its rows.
    self.logits = (
        distill.OfflineLogits(config, global_batch_size(config), self.train) if config.distill_logits_path else None
    )

  def batch(self, step: int, state) -> tuple[dict, dict]:
    """(this process's rows of `step`, entries for the step's record)."""
    del state
    rows = self.train.batch(step, jax.process_index(), jax.process_count())
    if self.logits is not None:
      self.logits.check_tokens(step, rows, jax.process_count())
      rows = {**rows, **self.logits.batch(step, jax.process_index(), jax.process_count())}
    damaged = getattr(self.train, "damaged", 0)  # grain_skip_damaged_records: those skipped so far (this process)
    return rows, ({"damaged_records": damaged} if damaged else {})

  def state(self):
    """What a checkpoint saves of the data (a Grain iterator's state), or None: in-memory batches are a
    pure function of the step."""
    return self.train.snapshot() if self.train.stateful else None

  def resume(self, checkpointer: checkpointing.Checkpointer, step: int) -> None:
    """Goes on from the data state saved with `step`; without one a Grain dataset replays up to it.

    With restart_data_on_resume, a Grain dataset whose saved state belongs to other data settings (or that has
    none: the run read other data) starts from its beginning at `step`; in-memory datasets, a pure function of
    the step, read the new data's batch of `step`."""
    if not self.train.stateful:
      return
    try:
      restored = checkpointer.restore_data(step, self.train.restore_item())
    except checkpointing.CheckpointError:  # saved with other data settings: refused unless restarting
      if not self.restart:
        raise
      restored = False
    if not restored and self.restart:
      self.train.restart_at(step)

  def close(self) -> None:
    for dataset in (self.train, self.eval):
      if dataset is not None and dataset.stateful:
        dataset.close()


class Sampled:
  """GRPO's batches: completions sampled from the policy as it trains (`grpo.Rollouts`); no held-out set."""

  eval = None
  # What the run learns from, as a dataset's keys are: its rewards and how they become advantages.
  fixed_keys = ("reward_function", "scale_rewards", "grpo_advantage_std", "dynamic_sampling")
  source_keys = (*fixed_keys, "max_num_gen_batches", "overlong_buffer_length", "overlong_penalty_factor")

  def __init__(self, config: Config, trainer: Trainer):
    self.rollouts = grpo.Rollouts(config, trainer)

  def batch(self, step: int, state) -> tuple[dict, dict]:
    rows, info = self.rollouts.batch(step, state)
    return rows, {key: value for key, value in info.items() if key != "completions"}  # its statistics

  def state(self):
    return None  # sampled from the policy, which the checkpoint holds

  def resume(self, checkpointer, step: int) -> None:
    pass

  def close(self) -> None:
    pass


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


def _source(config: Config) -> str:
  return os.path.abspath(config.load_parameters_path) if config.load_parameters_path else f"seed {config.seed}"


class _Fingerprinted(Hook):
  """A model the run is measured against, fixed when it starts: its source and a fingerprint of its values are
  recorded in `file` as the run first writes, and a resume whose model differs is refused before anything changes
  (the same path can hold other values by then)."""

  file: str
  role: str  # what the model is to the run, as the refusal says it
  key = "load_parameters_path"  # the setting that names the model

  def check(self, run: Run, params, source: str | None = None, param_scan_axis: int | None = None) -> None:
    axis = run.config.param_scan_axis if param_scan_axis is None else param_scan_axis
    self.reference = {
        "base": _source(run.config) if source is None else source,
        "fingerprint": canonical.fingerprint(params, axis),
    }
    path = run.run_dir / self.file
    if not path.is_file():
      return
    saved = json.loads(path.read_text())
    if saved["fingerprint"] != self.reference["fingerprint"]:
      raise checkpointing.CheckpointError(
          f"{run.run_dir}: {self.role} {saved['base']} (fingerprint {saved['fingerprint']}), not "
          f"{self.reference['base']} (fingerprint {self.reference['fingerprint']}); resume with the original "
          f"({self.key}, with the values it held), or start a new run_name"
      )

  def open(self, run_dir: Path) -> None:
    if not (run_dir / self.file).exists():
      files.write_text(run_dir / self.file, json.dumps(self.reference, indent=2) + "\n")


class FrozenReference(_Fingerprinted):
  """DPO's and GRPO's reference (`loss.StartingPolicy`): the run's starting policy, rebuilt on resume (checkpoints
  hold the policy only)."""

  file = REFERENCE_FILE
  role = "its reference model was"

  def start(self, run: Run) -> None:
    reference = run.initial() if run.resumed else run.state
    self.check(run, run.trainer.params(reference))
    run.trainer.hold_frozen(reference)


class LoraBase(_Fingerprinted):
  """Refuses to resume on another base than the adapters trained on, and records it (`lora.REFERENCE_FILE`)."""

  file = lora.REFERENCE_FILE
  role = "its adapters were trained on base"

  def start(self, run: Run) -> None:
    self.check(run, run.trainer.params(run.state))


class TeacherReference(_Fingerprinted):
  """Distillation's teacher: recorded in `TEACHER_FILE`, and a resume whose teacher's values differ is refused
  (`teacher_overrides` itself is fixed on resume: `distill.Distillation.fixed_keys`)."""

  file = TEACHER_FILE
  role = "its distillation teacher was"
  key = "teacher_overrides"

  def start(self, run: Run) -> None:
    teacher = run.trainer.loss.frozen
    self.check(run, run.trainer.hold_frozen(), teacher.source, teacher.config.param_scan_axis)


class MaxLogits(Hook):
  """QK-Clip: the largest attention logit over layers and heads, before clipping."""

  def record(self, metrics: dict, record: dict) -> None:
    if "maxima" in metrics:
      record["max_logits"] = float(metrics["maxima"]["max_logits"].max())


def tokenizer_fingerprint(folder: Path | None) -> dict[str, str]:
  """{file name: sha256} of the tokenizer files (`folders.TOKENIZER_FILES`) in `folder`; {} for None (bytes)."""
  if folder is None:
    return {}
  return {
      name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
      for name in folders.TOKENIZER_FILES
      if (folder / name).is_file()
  }


# The keys naming the model a new run starts from, in the order the loop reads them (a full state wins).
START_KEYS = ("load_full_state_path", "load_parameters_path")


def inherited_tokenizer(config: Config) -> tuple[str, Path] | None:
  """(the key, the folder) of the tokenizer a run without `tokenizer_path` takes from the model it starts from:
  the tokenizer.json beside the config.yml of the checkpoint load_full_state_path or load_parameters_path names
  (import-hf keeps a Hugging Face folder's there, a run its own `tokenizer_path`'s: `pretrained.tokenizer_folder`).
  None with tokenizer_path (the run's own), or when the model it starts from has none (a seed's, a byte-token run's)."""
  if config.tokenizer_path:
    return None
  key = next((key for key in START_KEYS if getattr(config, key)), None)
  folder = None if key is None else pretrained.tokenizer_folder(getattr(config, key))
  return None if folder is None else (key, folder)


def _byte_text(config: Config) -> str | None:
  """What of `config`'s batches is UTF-8 bytes as token ids whatever tokenizer_path says, or None (text a
  tokenizer_path tokenizes, or token ids: synthetic)."""
  if config.use_grpo:
    return "use_grpo=true samples from byte-token prompts"
  if config.dataset_type == "grain":
    return None
  if config.preference_loss or config.dataset_type == "sft":
    which = f"{config.preference_loss}=true" if config.preference_loss else "dataset_type='sft'"
    return None if config.dataset_path else f"the built-in set of {which} (no dataset_path) is byte tokens"
  if config.dataset_type in ("text", "embedded"):
    return f"dataset_type={config.dataset_type!r} reads byte tokens"
  return None


def data_config(config: Config) -> Config:
  """`config` as its data reads it: without tokenizer_path, with the tokenizer of the model the run starts from
  (`inherited_tokenizer`), so that the run trains on the ids the model and its serving read. Data that is bytes
  whatever the tokenizer (`_byte_text`) is refused for such a model: its embeddings are of the tokenizer's ids."""
  inherited = inherited_tokenizer(config)
  if inherited is None:
    return config
  key, folder = inherited
  byte_text = _byte_text(config)
  if byte_text is not None:
    raise ConfigError(
        f"{key}={getattr(config, key)!r} is a model trained with the tokenizer in {folder}, and {byte_text} (UTF-8 "
        "bytes as ids 0..255), which that model does not read: train it on text its tokenizer encodes "
        "(dataset_type='grain', or 'sft' with dataset_path), or on dataset_type='synthetic'"
    )
  return config.replace(tokenizer_path=str(folder))


class DataFiles(Hook):
  """The files an in-memory dataset reads (`dataset_path`: text, SFT and DPO rows), each with its fingerprint
  (`data_paths.fingerprint`), recorded in DATA_FILES as the run first writes. Its batches are a pure function of
  the step and of those files: a resume whose files were replaced, edited, added or removed since is refused
  before anything changes, naming the file, unless restart_data_on_resume (which reads the new data's batch of the
  step, and records the new files). A Grain dataset records its files in its saved state (`grain_data`). A run
  recorded before runs kept this file resumes unchecked, and keeps it from then on."""

  def start(self, run: Run) -> None:
    self.files = {
        data_paths.resolved(str(path)): data_paths.fingerprint(path) for path in data.text_files(run.config.dataset_path)
    }
    path = run.run_dir / DATA_FILES
    if not run.resumed or not path.is_file():
      if run.resumed and jax.process_index() == 0:  # a run from before this record: kept from now on
        files.write_text(path, json.dumps(self.files, indent=1))
      return
    saved = json.loads(path.read_text())
    changed = [f"{p}: new since the run started" for p in sorted(self.files.keys() - saved.keys())]
    changed += [f"{p}: gone since the run started" for p in sorted(saved.keys() - self.files.keys())]
    changed += [
        f"{p}: changed in place (fingerprint {saved[p]} -> {self.files[p]})"
        for p in sorted(saved.keys() & self.files.keys())
        if saved[p] != self.files[p]
    ]
    if changed and not run.config.restart_data_on_resume:
      raise checkpointing.CheckpointError(
          f"{run.run_dir}: its dataset_path files differ from those its checkpoints trained on ({'; '.join(changed)})"
          "; a step's batch would be another's. Restore the files, or set restart_data_on_resume=true to go on with "
          "the new data, or start a new run_name"
      )
    if changed and jax.process_index() == 0:  # the new data's, from now on
      files.write_text(path, json.dumps(self.files, indent=1))

  def open(self, run_dir: Path) -> None:
    files.write_text(run_dir / DATA_FILES, json.dumps(self.files, indent=1))


class RunTokenizer(Hook):
  """The run's tokenizer, one for the model: `tokenizer_path`'s files (tokenizer.json, tokenizer_config.json, a
  chat template) copied into the run folder as it first writes, where generate, serve, `Engine.from_pretrained`
  and export-hf read them (`pretrained.tokenizer_folder`). Without tokenizer_path, the tokenizer of the model the
  run starts from (`inherited_tokenizer`: an import-hf folder's, a run's) is the run's, copied and checked the same
  way (its data reads it too: `data_config`). A resume whose tokenizer files differ from the run's copy (by
  fingerprint, even with restart_data_on_resume: the model's embeddings are of its ids) is refused before anything
  changes, naming the file. (A run without either reads bytes and keeps no tokenizer.)"""

  def start(self, run: Run) -> None:
    self.source = Path(run.config.tokenizer_path) if run.config.tokenizer_path else None
    given_by, advice = "tokenizer_path", "tokenizer_path holding the files the run started with"
    inherited = inherited_tokenizer(run.config)
    if inherited is not None:
      key, self.source = inherited
      given_by, advice = f"{key}'s", f"{key} naming a model whose folder holds the files the run started with"
      logging.info("%s: no tokenizer_path; the run's tokenizer is %s's, from %s", run.run_dir, key, self.source)
    if self.source is None or not (run.run_dir / "tokenizer.json").is_file():
      # A new run or a byte-token one (a tokenizer.json copied in by hand stays), or one from before runs kept
      # their tokenizer: `open` copies it.
      return
    ours, given = tokenizer_fingerprint(run.run_dir), tokenizer_fingerprint(self.source)
    for name in sorted(ours.keys() | given.keys()):
      if ours.get(name) != given.get(name):
        digest = lambda prints: f"sha256 {prints[name][:16]}" if name in prints else "no such file"  # noqa: E731
        raise checkpointing.CheckpointError(
            f"{run.run_dir}: it trained with the tokenizer copied into it as it started, and {run.run_dir / name} "
            f"({digest(ours)}) differs from {self.source / name} ({digest(given)}, {given_by}); resume with "
            f"{advice} (its copy is in its folder), or start a new run_name"
        )

  def open(self, run_dir: Path) -> None:
    if self.source is not None and not (run_dir / "tokenizer.json").exists():
      folders.copy_tokenizer_files(self.source, run_dir)
