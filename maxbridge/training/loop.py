"""The training loop: one loop for every flag combination.

A run directory `<base_output_directory>/<run_name>/` holds `config.yml` (as the
run began; each resume's changes are appended to `config_history.jsonl`),
`metrics.jsonl` (one JSON object per step) and `checkpoints/<step>/`. Running
again with the same directory resumes from the latest checkpoint, whatever the
flags: both backends read and write the same checkpoint layout.
"""

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml
from absl import logging
from tqdm import tqdm

from maxbridge.core import checkpointing, files, sharding
from maxbridge.training import data, hooks
from maxbridge.training.initial import initial_state
from maxbridge.core.config import Config, ConfigError
from maxbridge.training import recipe
from maxbridge.training.hooks import global_batch_size  # noqa: F401  (callers' name for it: loop.global_batch_size)


class TrainingDiverged(FloatingPointError):
  pass


def run_directory(config: Config) -> Path:
  return Path(config.base_output_directory) / (config.run_name or config.model_name)


# Where and how often a run writes, and where a new run starts from: keys the train step never reads. With those
# only its batch sources read (`recipe.SOURCE_KEYS`), configs that differ only in these can share a trainer; most
# of them still change what a run computes, and the sources' and the frozen models' are fixed on resume
# (`recipe.resume_keys`).
_RUN_KEYS = frozenset(
    {
        "run_name",
        "base_output_directory",
        "enable_checkpointing",
        "checkpoint_period",
        "max_to_keep",
        "eval_interval",
        "eval_steps",
        "log_period",
        "restart_data_on_resume",
        "load_parameters_path",
        "load_full_state_path",
    }
)


def _check_resume(config: Config, run_dir: Path, keys: tuple[str, ...]) -> None:
  """Refuses a resume that would change what the run's checkpoints mean: one that changes any of `keys` (those
  fixed when it started, each feature's own: `recipe.resume_keys`), naming each key and both values.

  A path that names a model the run is measured against or trains on (a fixed key) may hold other values by then:
  the features' hooks check those by fingerprint as the run starts.
  """
  if not (run_dir / "config.yml").is_file():
    return
  saved = latest_config(run_dir)  # a resume with restart_data_on_resume changed its data keys
  now = _as_recorded(config)
  changed = [
      f"{key}: {saved[key]!r} -> {getattr(config, key)!r}"
      for key in keys
      if key in saved and not data.same_setting(key, saved[key], now[key])  # a path: what it names, not its spelling
  ]
  if changed:
    raise checkpointing.CheckpointError(
        f"{run_dir} cannot resume with other values of keys fixed when it started ({'; '.join(changed)}): its "
        "checkpoints would be read as another model's. Resume with the values in its config.yml, or choose a new "
        "run_name (or, for its data keys, set restart_data_on_resume=true to start the new data from its beginning)"
    )


def step_key(config: Config) -> tuple:
  """What a train step computes, from `config`: two configs with equal keys can share a trainer."""
  free = _RUN_KEYS | recipe.SOURCE_KEYS
  return tuple((k, v) for k, v in config.to_dict().items() if k not in free)


def _check_trainer(trainer, config: Config) -> None:
  ours, theirs = dict(step_key(config)), dict(step_key(trainer.config))
  differ = [f"{k} (trainer: {theirs.get(k)!r}, run: {ours.get(k)!r})" for k in sorted(ours) if ours[k] != theirs.get(k)]
  if differ:
    raise ValueError(f"trainer= was built for another config; it differs in {', '.join(differ)}")


class TrainingInterrupted(KeyboardInterrupt):
  """SIGINT or SIGTERM stopped the run; the message names the last good checkpoint.

  A KeyboardInterrupt, so that `except Exception` in a caller's code does not swallow it.
  """

  def __init__(self, message: str, signum: int = signal.SIGINT):
    super().__init__(message)
    self.signum = signum


class MetricsLog:
  """metrics.jsonl, one object per step.

  On resume, lines past the checkpoint (logged by a run that stopped before
  saving them) are dropped: the resumed run logs those steps again. Nothing
  else is ever removed. A torn last line, which a kill leaves, is dropped with
  a message; damage anywhere else is an error naming the line.
  """

  def __init__(self, path: Path, records: list[str], resume_step: int):
    self.path = path
    kept = "".join(line + "\n" for line in records if json.loads(line)["step"] < resume_step)
    if not path.exists() or path.read_text(encoding="utf-8") != kept:
      files.write_text(path, kept)

  @staticmethod
  def read(path: Path, report: bool = True) -> list[str]:
    """The lines of an existing log, checked; a torn last line is left out (with a message if `report`)."""
    if not path.exists():
      return []
    try:
      lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
      raise checkpointing.CheckpointError(f"{path} cannot be read: {e}") from e
    records = []
    for number, line in enumerate(lines, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
          raise ValueError("not an object with an integer step")
      except ValueError as e:
        if number == len(lines):
          if report:
            print(f"maxbridge: {path}:{number}: dropped a torn last line (a killed run leaves one)", file=sys.stderr)
          continue
        raise checkpointing.CheckpointError(
            f"{path}:{number}: not a metrics record ({e}); fix or remove that line to resume"
        ) from e
      records.append(line)
    return records

  def append(self, record: dict) -> None:
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")


class _StopSignals:
  """SIGINT and SIGTERM stop the run between steps, so that the exit names the last good checkpoint.

  The first signal is held until the loop checks (`check`), at a step
  boundary: an exception raised at an arbitrary point inside JAX's dispatch
  or orbax's bookkeeping could leave their threads waiting on each other, and
  the process hanging at exit. A second signal raises at once.
  """

  def __init__(self):
    self.caught: int | None = None
    self.installed = False

  def __call__(self, signum, frame):
    if self.caught is not None:
      raise TrainingInterrupted(_SIGNAL_NAMES[self.caught], self.caught)
    self.caught = signum

  def check(self) -> None:
    if self.caught is not None:
      raise TrainingInterrupted(_SIGNAL_NAMES[self.caught], self.caught)

  def started(self) -> None:
    """The first step has run: from here SIGTERM too is held until a step boundary (`_stop_signals`)."""
    if self.installed:
      signal.signal(signal.SIGTERM, self)


_SIGNAL_NAMES = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}


@contextlib.contextmanager
def _stop_signals():
  """Installs a `_StopSignals` for SIGINT and SIGTERM while the run lasts (main thread only).

  SIGTERM keeps its default action (the process ends at once) until the first step has run: a Python handler runs
  only between bytecodes, so it would wait out the first compile, minutes for a large model, while a scheduler's
  grace period runs out. Nothing is lost: a run's files change only once its first step has run, and a run
  killed before that starts again by itself. SIGINT is held from the start (an interactive session's interrupt
  must not end its process).
  """
  stop = _StopSignals()
  if threading.current_thread() is not threading.main_thread():
    yield stop
    return
  previous = {s: signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else stop) for s in _SIGNAL_NAMES}
  stop.installed = True
  try:
    yield stop
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


@contextlib.contextmanager
def _signals_deferred():
  """Holds SIGINT and SIGTERM while orbax starts a save, then acts on them: an interrupt inside
  orbax's bookkeeping could leave its threads waiting on each other."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  caught = []
  previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    if caught:  # now acted on as it would have been
      handler = previous[caught[0]]
      if callable(handler):
        handler(caught[0], None)
      elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), caught[0])


def _check_writable(path: Path) -> None:
  # Found now, not when the first checkpoint is due, hours into the run.
  existing = next(p for p in (path, *path.parents) if p.exists())
  if not existing.is_dir():
    raise checkpointing.CheckpointError(f"{existing} is a file, so the run folder {path} cannot be made")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise checkpointing.CheckpointError(f"{existing} is not writable, so nothing can be saved under {path}")


def _check_folder(path: Path) -> None:
  if path.exists() and not path.is_dir():
    raise checkpointing.CheckpointError(f"{path} exists and is not a folder; move it away or choose another run_name")


def train(config: Config, *, trainer=None, until_step: int | None = None, progress: bool = True) -> list[dict]:
  """Trains `config` in its run directory (resuming if it holds checkpoints); returns this call's metrics.

  `until_step` stops this call early (with a checkpoint) without changing the
  run: the schedule still spans `config.steps`, so a later call continues it.
  `trainer` (from `recipe.create_trainer`, for a config with the same
  `step_key`) brings its own loss and after-update hook, and its compiled
  steps: pass the same one to several calls in a process (a resume, a flag
  flip back) to compile once. The run's batches and its features' hooks come
  from `recipe.create_hooks`.

  One process at a time writes a run directory: a second `train` of the
  same run fails at once (`files.RunInUse`, naming the holder's pid).
  Nothing in the run directory changes until the run is known to start (data
  read, checkpoint restored into the model, first step compiled and run); a
  run that fails before saving a checkpoint removes the folder it created. A failure, SIGINT or SIGTERM ends
  the call with the last good checkpoint named (TrainingInterrupted for the
  signals; a note on any other exception).
  """
  with _stop_signals() as stop, contextlib.ExitStack() as held:
    return _train(config, trainer, until_step, progress, stop, held)


def _train(
    config: Config, trainer, until_step: int | None, progress: bool, stop: _StopSignals, held: contextlib.ExitStack
) -> list[dict]:
  end = config.steps if until_step is None else min(until_step, config.steps)
  if config.compile_topology:
    raise ConfigError(
        f"compile_topology={config.compile_topology!r} is for `maxbridge compile` (a fit checked for a slice this "
        "host lacks); a run trains on this host's devices: drop the key"
    )
  if trainer is not None:
    _check_trainer(trainer, config)
  sharding.initialize_distributed(config)
  # Every process trains and checkpoints (orbax saves collectively); one writes the logs.
  primary = jax.process_index() == 0
  run_dir = run_directory(config)
  checkpoints = run_dir / "checkpoints"
  _check_folder(run_dir)
  _check_folder(checkpoints)
  _check_writable(checkpoints if config.enable_checkpointing else run_dir)
  if primary:
    # One writer per run folder, taken before anything in it is read (orbax's manager lists, and may tidy,
    # the step folders a holder is writing) and held until this call returns.
    held.enter_context(files.run_lock(run_dir))
  if trainer is None:
    trainer = recipe.create_trainer(config)
  sharding.check_divisible(trainer.abstract_state(), trainer.state_shardings)
  source, features = recipe.create_hooks(config, trainer)
  held.callback(source.close)  # a Grain pipeline's worker processes
  # Read-only with enable_checkpointing=false: the run resumes, and saves nothing.
  ckpt = (
      checkpointing.Checkpointer(checkpoints, max_to_keep=config.max_to_keep, create=False)
      if config.enable_checkpointing or checkpoints.is_dir()
      else None
  )
  saving = ckpt if config.enable_checkpointing else None
  try:
    start = (ckpt.latest_intact_step() if ckpt else None) or 0
    metrics_path = run_dir / "metrics.jsonl"
    # Every process decides the same: the run folder is shared (orbax saves into it collectively).
    history = MetricsLog.read(metrics_path, report=primary)
    # An earlier attempt that saved no checkpoint (killed early, or not checkpointing) is set aside once this one
    # has started (`_open_run`), so that a failed start leaves the folder as it was.
    earlier = len(history) if not start else 0
    if earlier:
      history = []
    resumed = bool(start)
    initial = functools.partial(initial_state, config, trainer)
    if resumed:
      _check_resume(config, run_dir, recipe.resume_keys(config, trainer))
      # As in MaxText, a run's own checkpoints win over load_parameters_path / load_full_state_path.
      restored = ckpt.restore(start, trainer.checkpoint_target())
      # The trained tree only, for a policy that saves no more: its frozen base comes from where the run started,
      # checked by a hook below.
      state = trainer.restore(restored, initial)
      source.resume(ckpt, start)  # a Grain iterator's state, saved with the step
      logging.info("resumed %s from step %d", run_dir, start)
    else:
      state = initial()
      start = trainer.step(state)
    run = hooks.Run(config, trainer, run_dir, state, resumed, initial)
    for feature in features:
      feature.start(run)
  except KeyboardInterrupt as e:
    raise _stopped(e, None, ckpt, checkpoints, None) from None
  except BaseException:
    if ckpt:
      ckpt.close()
    raise

  new_run = not run_dir.exists()
  records = []
  bar = tqdm(
      range(start, end),
      initial=start,
      total=config.steps,
      desc=run_dir.name,
      unit="step",
      disable=not (progress and primary),
  )
  step, log = start, None
  try:
    for step in bar:
      stop.check()
      local, entries = source.batch(step, state)
      batch = trainer.shard_batch(local)
      began = time.perf_counter()
      state, metrics = trainer.train_step(state, batch)
      metrics = jax.device_get(metrics)  # also waits for the step: the timing below is real
      seconds = time.perf_counter() - began
      if step == start:
        # The first step compiled and ran (a step that cannot be built fails above): the run has
        # started, and from here on it writes into its folder.
        stop.started()  # before the run's files change
        log = _open_run(config, run_dir, history, start, saving, primary, features, earlier)
      loss = float(metrics["loss"])
      if not math.isfinite(loss):
        raise TrainingDiverged(f"loss is {loss} at step {step}; training stopped")
      record = {
          "step": step,
          "loss": loss,
          "lr": float(metrics["lr"]),
          "grad_norm": float(metrics["grad_norm"]),
          "tokens_per_s": float(metrics["tokens"]) / seconds,
      }
      for key in trainer.loss.metric_keys:  # the loss's own
        record[key] = float(metrics[key])
      record.update(entries)  # the batch source's (a sampled batch's statistics)
      for feature in features:
        feature.record(metrics, record)
      done = step + 1
      if source.eval is not None and (done % config.eval_interval == 0 or done == config.steps):
        record["eval_loss"] = evaluate(trainer, state, source.eval, config.eval_steps)
      if log:
        log.append(record)
      records.append(record)
      bar.set_postfix(loss=f"{loss:.3f}")
      if done % config.log_period == 0 and not bar.disable:
        bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step"), sys.stderr)
      if saving and (done % config.checkpoint_period == 0 or done == end):
        tree = trainer.to_checkpoint(state)
        # A finite loss at this step says nothing of the update it made: check
        # the state itself, so the last checkpoint is always a good one.
        if not _all_finite(tree):
          raise TrainingDiverged(f"the state became non-finite at step {step}; training stopped")
        with _signals_deferred():
          saving.save(done, tree, data=source.state())
    if saving:
      saving.wait()  # the last save's failure surfaces here, not after we report success
  except BaseException as e:
    bar.close()
    raise _stopped(e, step, ckpt, checkpoints, run_dir if new_run and primary else None) from None
  bar.close()
  if ckpt:
    ckpt.close()
  return records


def _open_run(
    config: Config,
    run_dir: Path,
    history: list[str],
    start: int,
    saving,
    primary: bool,
    features: list[hooks.Hook],
    earlier: int = 0,
):
  """Writes the run's config.yml (and its features' files: the fingerprint of a model it is fixed to) and makes its
  folders; returns its metrics log (None off the primary). `earlier`: the steps an attempt that saved no checkpoint
  logged, whose files are first moved aside."""
  if earlier and primary:
    aside = files.set_aside(run_dir, keep=run_dir / "checkpoints")
    logging.warning(
        "%s: the earlier attempt logged %d steps but saved no checkpoint; started again from step 0, its files "
        "kept in %s",
        run_dir,
        earlier,
        aside,
    )
  run_dir.mkdir(parents=True, exist_ok=True)
  if saving:
    Path(saving.directory).mkdir(exist_ok=True)
  if not primary:
    return None
  _record_config(config, run_dir, start)
  for feature in features:
    feature.open(run_dir)
  if saving:
    saving.remove_temporaries()
  return MetricsLog(run_dir / "metrics.jsonl", history, resume_step=start)


CONFIG_HISTORY = "config_history.jsonl"


def _as_recorded(config: Config) -> dict:
  """`config`'s keys as config.yml and config_history.jsonl read back (tuples are lists), to compare with them."""
  return json.loads(json.dumps(config.to_dict()))


def _record_config(config: Config, run_dir: Path, start: int) -> None:
  """Writes config.yml as the run starts. A resume leaves it as it is and appends the keys it changes (those
  `recipe.resume_keys` leaves free: learning rate, steps, logging...) to config_history.jsonl, with its step."""
  path = run_dir / "config.yml"
  if not path.is_file():
    config.to_yaml(path)
    return
  last = latest_config(run_dir)
  now = _as_recorded(config)
  for key in ("base_output_directory", "run_name"):  # where the folder is, not what runs in it (it may move)
    now.pop(key), last.pop(key, None)
  changed = {
      key: [last.get(key), now.get(key)] for key in sorted(now.keys() | last.keys()) if last.get(key) != now.get(key)
  }
  if not changed:
    return
  entry = {"step": start, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changed": changed}
  with (run_dir / CONFIG_HISTORY).open("a") as f:
    f.write(json.dumps(entry) + "\n")
  logging.info("%s resumed at step %d with %s", run_dir, start, ", ".join(f"{k}={v[1]!r}" for k, v in changed.items()))


def latest_config(run_dir: str | os.PathLike) -> dict:
  """The keys a run last ran with: its config.yml, with each resume's changes (config_history.jsonl) applied."""
  values = yaml.safe_load((Path(run_dir) / "config.yml").read_text()) or {}
  history = Path(run_dir) / CONFIG_HISTORY
  lines = history.read_text().splitlines() if history.is_file() else []
  for number, line in enumerate(lines, start=1):
    try:
      values.update({key: new for key, (_, new) in json.loads(line)["changed"].items()})
    except (ValueError, KeyError, TypeError) as e:
      if number < len(lines):  # a torn last line is a resume killed as it wrote: nothing ran with it
        raise checkpointing.CheckpointError(
            f"{history}:{number}: not a config change ({e}); fix or remove that line"
        ) from e
  return values


def _stopped(error: BaseException, step: int | None, ckpt, checkpoints: Path, created: Path | None) -> BaseException:
  """`error`, once the save in flight has finished, saying where the run can resume from.

  A run folder this call created and never checkpointed into is removed: a
  failed new run leaves nothing behind.
  """
  late = ckpt.close() if ckpt else None  # waits for the save in flight, never raises
  steps = ckpt.intact_steps() if ckpt else []
  last_good = checkpointing.describe_last_good(checkpoints, steps)
  removed = ""
  if created is not None and not steps:
    shutil.rmtree(created, ignore_errors=True)
    removed = f"; removed the new run folder {created}"
  if isinstance(error, KeyboardInterrupt):
    signum = getattr(error, "signum", signal.SIGINT)
    what = "interrupted (SIGINT)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    when = f"at step {step}" if step is not None else "before training started"
    return TrainingInterrupted(f"{what} {when}; the last good checkpoint: {last_good}{removed}", signum)
  if isinstance(error, TrainingDiverged):
    return TrainingDiverged(f"{error}. The last good checkpoint: {last_good}{removed}")
  if late is not None and not isinstance(error, checkpointing.CheckpointSaveError):
    error.add_note(str(late))
  error.add_note(f"the last good checkpoint: {last_good}{removed}")
  return error


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
