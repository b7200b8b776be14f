"""Faults and bad input (issue 9): no hang, no rewritten run folder, no silent wrong answer, one error style.

Every in-process run shares one config (`_config`), so the train step compiles
once; subprocesses are used only where the exit status, a hang or a signal is
the point, and share the run's compilation cache (`conftest.py`).
"""

import contextlib
import importlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import converters
import maxbridge as mb
from maxbridge.core import checkpointing, files
from maxbridge import cli
from maxbridge.training import data, hooks, loop
from maxbridge.interop import hf
from maxbridge.core.config import ConfigError
from maxbridge.interop import pretrained
from conftest import LINEN_ARGS, LINEN_FLAGS

REPO = Path(__file__).resolve().parent.parent
# Run-only keys differ between runs below; everything a step computes is the same, in Linen (NNX is the default).
RUN = dict(steps=3, per_device_batch_size=2, checkpoint_period=1, eval_interval=0, **LINEN_FLAGS)


def _config(tmp_path, name="run", **overrides):
  return mb.load_config("llama-tiny", base_output_directory=str(tmp_path), run_name=name, **{**RUN, **overrides})


def _train(tmp_path, name="run", until_step=None, **overrides):
  return mb.train(_config(tmp_path, name, **overrides), until_step=until_step, progress=False)


def _snapshot(folder: Path) -> dict[str, tuple]:
  """Every file under `folder`: bytes and mode, by relative path (folders too)."""
  return {
      str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mode)
      for p in sorted(folder.rglob("*"))
  }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
  """A run trained to step 2 of 3, checkpoints at 1 and 2; tests copy it before changing anything."""
  base = tmp_path_factory.mktemp("trained")
  _train(base, until_step=2)
  return base / "run"


def _copy(run: Path, tmp_path: Path, name: str = "run") -> Path:
  shutil.copytree(run, tmp_path / name)
  return tmp_path / name


def _metrics_steps(run: Path) -> list[int]:
  return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _non_daemon_threads() -> set[threading.Thread]:
  return {t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()}


@pytest.fixture(scope="module")
def cli_env() -> dict[str, str]:
  """Environment for CLI subprocesses: our code first (the run's compilation cache comes with `os.environ`)."""
  return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _cli_args(tmp_path, name, **overrides) -> list[str]:
  values = {**RUN, "base_output_directory": tmp_path, "run_name": name, **overrides}
  return ["train", "llama-tiny", *(f"{k}={v}" for k, v in values.items())]


# --- 1. a failed save, SIGINT or SIGTERM ends the process within seconds -----------------


@contextlib.contextmanager
def _file_size_limit(limit: int):
  """Writes past `limit` bytes fail with EFBIG (a full disk, as far as orbax can tell), inside the block only:
  kept short and well above what a test logs, since the limit holds for pytest's own files too."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


@pytest.mark.parametrize("fault", ["file-in-the-way", "disk-full"])
def test_a_failed_save_raises_and_leaves_no_thread_waiting(tmp_path, fault):
  """The hang was at exit: orbax's commit threads waited for ever for a folder that never came."""
  directory = tmp_path / "checkpoints"
  before = _non_daemon_threads()
  ckpt = checkpointing.Checkpointer(directory, create=False)
  tree = {"w": jnp.arange(1 << 20, dtype=jnp.float32)}  # 4 MiB: past the size limit
  if fault == "file-in-the-way":
    directory.write_text("not a folder")
  limit = _file_size_limit(1 << 20) if fault == "disk-full" else contextlib.nullcontext()
  with limit, pytest.raises(checkpointing.CheckpointSaveError, match=f"could not save checkpoint step 1 in {directory}"):
    ckpt.save(1, tree)
    ckpt.wait()
  assert ckpt.close() is None  # the error was reported once, by save/wait
  deadline = time.monotonic() + 10
  while _non_daemon_threads() - before and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _non_daemon_threads() - before, f"threads left running: {_non_daemon_threads() - before}"


def test_cli_train_whose_save_fails_exits_2_in_seconds_naming_the_last_good_checkpoint(tmp_path, cli_env):
  limit = "import resource, signal, runpy, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
  limit += "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000)); "
  limit += "sys.argv[0] = 'maxbridge'; runpy.run_module('maxbridge.cli', run_name='__main__')"
  env = {k: v for k, v in cli_env.items() if not k.startswith("JAX_")}  # the limit would cut cache files
  proc = subprocess.run(
      [sys.executable, "-c", limit, *_cli_args(tmp_path, "full")], env=env, capture_output=True, text=True, timeout=180
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "maxbridge train: could not save checkpoint step 1" in proc.stderr
  assert "the last good checkpoint: none" in proc.stderr and "removed the new run folder" in proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert not (tmp_path / "full").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_training_naming_the_last_good_checkpoint(tmp_path, cli_env, signum):
  args = _cli_args(tmp_path, "sig", steps=100_000, checkpoint_period=2)
  proc = subprocess.Popen([sys.executable, "-m", "maxbridge.cli", *args], env=cli_env, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 240
    while not (tmp_path / "sig" / "checkpoints" / "2" / "items" / "_METADATA").exists():
      assert proc.poll() is None, proc.stderr.read()[-3000:]
      assert time.monotonic() < deadline, "no checkpoint in time"
      time.sleep(0.2)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signum, err[-3000:]
  name = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted (SIGINT)"
  assert f"maxbridge train: {name} at step" in err
  assert "the last good checkpoint: step " in err and str(tmp_path / "sig" / "checkpoints") in err
  assert "Traceback" not in err


def test_a_first_signal_is_held_for_the_step_boundary_and_a_second_stops_at_once():
  train_lib = importlib.import_module("maxbridge.training.loop")  # `maxbridge.train` the attribute is the function
  stop = train_lib._StopSignals()  # pylint: disable=protected-access
  stop.check()  # nothing caught: the loop goes on
  stop(signal.SIGTERM, None)  # held, not raised inside whatever JAX or orbax is doing
  with pytest.raises(train_lib.TrainingInterrupted, match=r"terminated \(SIGTERM\)"):
    stop.check()
  with pytest.raises(train_lib.TrainingInterrupted, match=r"terminated \(SIGTERM\)"):
    stop(signal.SIGINT, None)


# --- 2. a failed command leaves the user's files as they were ------------------------------


def test_a_resume_that_does_not_fit_leaves_the_run_folder_byte_identical(trained, tmp_path):
  run = _copy(trained, tmp_path)
  before = _snapshot(run)
  with pytest.raises(checkpointing.CheckpointError, match=r"fixed when it started \(base_emb_dim: 64 -> 32\)"):
    _train(tmp_path, base_emb_dim=32)
  assert _snapshot(run) == before


def test_a_failing_command_on_a_damaged_run_leaves_it_byte_identical(trained, tmp_path):
  run = _copy(trained, tmp_path)
  shutil.rmtree(run / "checkpoints" / "2" / "items")
  before = _snapshot(run)
  with pytest.raises(checkpointing.CheckpointError):
    _train(tmp_path)
  assert _snapshot(run) == before


def test_a_resume_whose_first_step_fails_leaves_the_run_folder_byte_identical(trained, tmp_path):
  # The checkpoint fits (tiling changes no parameter); the step itself cannot be built.
  run = _copy(trained, tmp_path)
  before = _snapshot(run)
  with pytest.raises(ConfigError, match=r"num_vocab_tiling=3 does not divide the \d+ rows") as raised:
    _train(tmp_path, num_vocab_tiling=3)
  assert "the last good checkpoint: step 2" in str(raised.value.__notes__)
  assert _snapshot(run) == before


def test_training_without_checkpointing_on_an_existing_run_keeps_its_history(trained, tmp_path):
  run = _copy(trained, tmp_path)
  records = _train(tmp_path, enable_checkpointing=False)
  assert [r["step"] for r in records] == [2], "resumed from the latest checkpoint, read-only"
  assert _metrics_steps(run) == [0, 1, 2]
  assert checkpointing.Checkpointer(run / "checkpoints").all_steps() == [1, 2], "nothing saved"


def test_a_run_killed_before_its_first_checkpoint_starts_again_keeping_its_files_aside(trained, tmp_path):
  # kill -9 before the first save commits: the attempt's metrics and config are there, no checkpoint.
  run = _copy(trained, tmp_path)
  shutil.rmtree(run / "checkpoints")
  before = _snapshot(run)
  with pytest.raises(ValueError, match="no files match dataset_path"):  # a start that fails changes nothing
    _train(tmp_path, dataset_type="text", dataset_path=str(tmp_path / "nowhere"))
  assert _snapshot(run) == before
  records = _train(tmp_path)
  assert [r["step"] for r in records] == [0, 1, 2] and _metrics_steps(run) == [0, 1, 2]
  assert _snapshot(run / "aborted" / "1") == before, "the earlier attempt's files, moved aside unchanged"
  assert checkpointing.Checkpointer(run / "checkpoints").latest_step() == 3
  # Without checkpointing too, and a second time: the next number.
  _train(tmp_path, enable_checkpointing=False, name="plain")
  _train(tmp_path, enable_checkpointing=False, name="plain")
  assert sorted(p.name for p in (tmp_path / "plain" / "aborted").iterdir()) == ["1"]
  assert _metrics_steps(tmp_path / "plain" / "aborted" / "1") == _metrics_steps(tmp_path / "plain") == [0, 1, 2]


def test_a_new_run_with_bad_data_creates_nothing(tmp_path):
  with pytest.raises(ValueError, match="no files match dataset_path"):
    _train(tmp_path, name="new", dataset_type="text", dataset_path=str(tmp_path / "nowhere"))
  assert not (tmp_path / "new").exists()


def _mismatched_config(run: Path) -> None:
  """config.yml that no longer describes the checkpoint, as the old failed resume left it."""
  values = yaml.safe_load((run / "config.yml").read_text())
  values["base_mlp_dim"] = 96
  (run / "config.yml").write_text(yaml.safe_dump(values))


def test_export_hf_refuses_a_config_that_does_not_describe_the_checkpoint(trained, tmp_path):
  run = _copy(trained, tmp_path)
  _mismatched_config(run)
  with pytest.raises(hf.HFError, match=r"does not describe its checkpoint.*mlp/wi_0/kernel has shape"):
    pretrained.export_hf(run, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_convert_refuses_a_config_that_does_not_describe_the_checkpoint(trained, tmp_path):
  run = _copy(trained, tmp_path)
  _mismatched_config(run)
  with pytest.raises(converters.ConversionError, match=r"does not describe the checkpoint.*mlp/wi_0/kernel"):
    converters.convert(run, tmp_path / "out", layout="nnx")
  assert not (tmp_path / "out").exists()


# --- 3. inputs we do not implement exactly are refused, naming the field ---------------------


@pytest.fixture(scope="module")
def model():
  return mb.create_model(mb.load_config("llama-tiny", **LINEN_FLAGS), seed=0)


@pytest.mark.parametrize("bad", [-1, 256])
def test_token_ids_outside_the_vocabulary_are_refused(model, bad):
  tokens = np.array([[1, 2, bad]], np.int32)
  with pytest.raises(ValueError, match=rf"tokens hold token id {bad}, outside \[0, vocab_size=256\)"):
    model.logits(tokens)
  with pytest.raises(ValueError, match=rf"prompt hold token id {bad}"):
    model.generate(tokens[0], 2)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(max_target_length=1), "max_target_length=1 is too short to train on"),
        (dict(trainable_position_size=32), "max_target_length=64 exceeds trainable_position_size=32"),
    ],
)
def test_configs_that_cannot_train_are_refused_at_load_time(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("llama-tiny", **overrides)


def test_data_with_no_targets_is_refused():
  rows = data.pack([np.array([i]) for i in range(10)], 4)
  with pytest.raises(ValueError, match="no token has a next token to predict"):
    data.Dataset(rows, 2, 0)


_HF_LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=256,
)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(hidden_size=66), "hidden_size=66 is not a multiple of num_attention_heads=4"),
        (dict(num_hidden_layers="2"), "num_hidden_layers='2' must be an integer"),
        (dict(rms_norm_eps="small"), "rms_norm_eps='small' must be a number"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear' is not supported"),
        (dict(tie_word_embeddings="false"), "tie_word_embeddings='false' must be true or false"),
    ],
)
def test_hugging_face_configs_we_cannot_honour_are_refused(changes, match):
  from maxbridge.interop.hf.mapping import config_from_hf

  with pytest.raises(hf.HFError, match=match):
    config_from_hf({**_HF_LLAMA, **changes})


def test_an_override_on_import_wins_over_config_json():
  from maxbridge.interop.hf.mapping import config_from_hf

  assert config_from_hf(_HF_LLAMA, "rope_max_timescale=500000").rope_max_timescale == 500000


# --- 4. damaged files: one line naming the step folder and the intact step before it -----


@pytest.mark.parametrize("damage", ["empty-step", "garbage-metadata", "missing-metadata"])
def test_a_damaged_latest_step_names_itself_and_the_intact_step(trained, tmp_path, damage):
  run = _copy(trained, tmp_path)
  step = run / "checkpoints" / "2"
  if damage == "empty-step":
    shutil.rmtree(step)
    step.mkdir()
  elif damage == "garbage-metadata":
    (step / "items" / "_METADATA").write_bytes(b"\x00garbage{")
  else:
    (step / "items" / "_METADATA").unlink()
  with pytest.raises(checkpointing.CheckpointError) as error:
    _train(tmp_path)
  message = str(error.value)
  assert "\n" not in message
  assert f"{step} is damaged" in message and "step 1 is intact" in message, message


def test_readers_skip_a_damaged_latest_step_and_say_so(trained, tmp_path, capfd):
  run = _copy(trained, tmp_path)
  (run / "checkpoints" / "2" / "items" / "_METADATA").write_text("{not json")
  _, info = converters.load_params(run)
  assert info.step == 1
  assert f"skipped {run / 'checkpoints' / '2'}" in capfd.readouterr().err


def test_a_torn_last_metrics_line_is_dropped_and_the_run_resumes(trained, tmp_path, capfd):
  run = _copy(trained, tmp_path)
  log = run / "metrics.jsonl"
  log.write_text(log.read_text() + '{"step": 2, "lo')  # what a kill mid-write leaves
  assert [r["step"] for r in _train(tmp_path)] == [2]
  assert "dropped a torn last line" in capfd.readouterr().err
  assert _metrics_steps(run) == [0, 1, 2]


def test_a_damaged_metrics_line_that_is_not_the_last_is_named(trained, tmp_path):
  run = _copy(trained, tmp_path)
  log = run / "metrics.jsonl"
  lines = log.read_text().splitlines()
  log.write_text("\n".join(["{broken", *lines[1:]]) + "\n")
  with pytest.raises(checkpointing.CheckpointError, match=r"metrics.jsonl:1: not a metrics record"):
    _train(tmp_path)


# --- 5. one error style: bad input exits 2 with a message, no traceback --------------------


def _cli(argv, capsys) -> tuple[int, str]:
  try:
    code = cli.main([str(a) for a in argv])
  except SystemExit as e:  # argparse's usage errors
    code = e.code
  return code, capsys.readouterr().err


def test_bad_input_exits_2_with_one_message(tmp_path, capsys):
  not_utf8 = tmp_path / "bad.yml"
  not_utf8.write_bytes(b"steps: 3\nrun_name: \xff\n")
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text("[1, 2]")
  truncated = tmp_path / "trunc"
  truncated.mkdir()
  (truncated / "config.json").write_text(json.dumps(_HF_LLAMA))
  (truncated / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
  latin1 = tmp_path / "data.jsonl"
  latin1.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
  a_file = tmp_path / "a-file"
  a_file.write_text("")
  cases = [
      (["train", not_utf8], "is not UTF-8"),
      (["train", "llama-tiny", "vocab_size=100", f"base_output_directory={tmp_path}", *LINEN_ARGS], "vocab_size=100"),
      (["import-hf", folder, tmp_path / "out"], "must hold a JSON object"),
      (["import-hf", truncated, tmp_path / "out"], "not a readable safetensors file"),
      (["compare", tmp_path, tmp_path], "is not a checkpoint"),
      (["shardings", "--devices", "-2", "llama-tiny"], "'-2' must be >= 0"),
      (
          ["train", "llama-tiny", "dataset_type=text", f"dataset_path={latin1}", f"base_output_directory={tmp_path}"]
          + LINEN_ARGS,
          "data.jsonl: not UTF-8",
      ),
      (["train", "llama-tiny", f"base_output_directory={a_file}", *LINEN_ARGS], "a-file is a file"),
  ]
  for argv, match in cases:
    code, err = _cli(argv, capsys)
    assert code == 2, (argv, err)
    assert match in err and "Traceback" not in err, (argv, err)
  assert not (tmp_path / "out").exists()


def test_an_internal_failure_exits_1_and_debug_shows_the_traceback(capsys, monkeypatch):
  def broken(args):
    raise RuntimeError("a bug")

  monkeypatch.setitem(cli.HANDLERS, "compile", broken)
  code, err = _cli(["compile", "llama-tiny"], capsys)
  assert code == 1 and "internal error: RuntimeError: a bug" in err and "Traceback" not in err
  code, err = _cli(["compile", "llama-tiny", "--debug"], capsys)
  assert code == 1 and "Traceback" in err
  monkeypatch.setenv(cli.DEBUG_ENV, "1")
  code, err = _cli(["compile", "llama-tiny"], capsys)
  assert code == 1 and "Traceback" in err


def test_library_errors_logged_from_their_threads_or_by_the_garbage_collector_print_no_traceback(cli_env):
  """After a failed save, asyncio logs each of orbax's unawaited write tasks when it is collected,
  at a moment that varies from run to run: the command's own message already said it all."""
  script = (
      "import logging, sys; from maxbridge import cli; cli._quiet_library_tracebacks(); logging.basicConfig()\n"
      "for name in ('absl', 'asyncio'):\n"
      "  try:\n"
      "    raise ValueError(f'OUT_OF_RANGE from {name}')\n"
      "  except ValueError:\n"
      "    logging.getLogger(name).exception('Task exception was never retrieved')\n"
  )
  proc = subprocess.run([sys.executable, "-c", script], env=cli_env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stderr.count("Task exception was never retrieved") == 2, proc.stderr
  assert "Traceback" not in proc.stderr and "OUT_OF_RANGE" not in proc.stderr, proc.stderr


def test_a_mesh_that_does_not_divide_a_parameter_names_it(cli_env):
  argv = ["compile", "--devices", "8", "llama-tiny", "ici_tensor_parallelism=8", *LINEN_ARGS]
  proc = subprocess.run(
      [sys.executable, "-m", "maxbridge.cli", *argv], env=cli_env, capture_output=True, text=True, timeout=180
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "self_attention/key/kernel (64, 2, 2, 16): dimension 2 (2) does not divide over the mesh axes tensor=8" in (
      proc.stderr
  )
  assert "Traceback" not in proc.stderr


# --- 6. temporaries of a killed run are removed by the next run of the same command ---------


def _dead_pid() -> int:
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


def _leftover(destination: Path, tag: str, pid: int, host: str | None = None) -> Path:
  host = host or files._host()  # pylint: disable=protected-access
  path = destination.parent / f".{destination.name}.{tag}-{host}-{pid}-abc123"
  (path / "items").mkdir(parents=True)
  return path


def test_stale_temporaries_of_a_killed_convert_are_removed(trained, tmp_path):
  out = tmp_path / "converted"
  stale = _leftover(out, "converting", _dead_pid())
  alive = _leftover(out, "converting", os.getppid())
  elsewhere = _leftover(out, "converting", _dead_pid(), host="otherhost")
  converters.convert(trained, out, layout="nnx")
  assert not stale.exists(), "a dead process's staging folder for this destination goes"
  assert alive.exists() and elsewhere.exists(), "a live process's, or another host's, stays"
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted([alive.name, elsewhere.name])


def test_stale_temporaries_of_a_killed_import_and_save_are_removed(trained, tmp_path):
  out = tmp_path / "exported"
  stale = _leftover(out, "writing", _dead_pid())
  pretrained.export_hf(trained, out)
  assert not stale.exists() and (out / "config.json").is_file()
  run = _copy(trained, tmp_path, "resumed")
  orbax_tmp = run / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
  orbax_tmp.mkdir()
  _train(tmp_path, name="resumed")
  assert not orbax_tmp.exists() and (run / "checkpoints" / "3" / "items").is_dir()


# --- 7. values that were accepted without comment --------------------------------------------


def test_non_finite_and_duplicate_config_values_are_refused(tmp_path):
  with pytest.raises(ConfigError, match="'learning_rate' = inf is invalid; it must be a finite number"):
    mb.load_config("llama-tiny", "learning_rate=inf")
  twice = tmp_path / "twice.yml"
  twice.write_text("steps: 3\nbase_emb_dim: 64\nsteps: 5\n")
  with pytest.raises(ConfigError, match=r"twice.yml:3: not valid YAML: key 'steps' appears twice \(lines 1 and 3\)"):
    mb.load_config(str(twice))


def test_generate_refuses_bad_values_and_warns_past_max_target_length(model):
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    model.generate([1, 2], 2, temperature=float("nan"))
  with pytest.raises(ValueError, match="max_new_tokens must be a whole number, got 2.5"):
    model.generate([1, 2], 2.5)
  with pytest.warns(UserWarning, match="= 66 exceeds max_target_length=64"):
    model.generate(list(range(60)), 6)


def test_a_run_of_short_sequences_is_read_with_a_prefill_that_fits_unless_one_is_named(trained):
  # The run as if trained with max_target_length=32, under the default prefill of 32: no room to generate.
  config, _ = pretrained.load_pretrained(trained, "max_target_length=32")
  assert (config.max_target_length, config.max_prefill_predict_length) == (32, 16)
  named, _ = pretrained.load_pretrained(trained, "max_target_length=32", "max_prefill_predict_length=32")
  with pytest.raises(ValueError, match=r"max_prefill_predict_length=32 must be in \[1, max_target_length=32\)"):
    mb.Engine(named)


def test_compare_refuses_negative_or_nan_tolerances(trained, capsys):
  for atol in (-1.0, float("nan")):
    with pytest.raises(converters.ConversionError, match="atol=.* must be a finite number >= 0"):
      converters.compare(trained, trained, atol=atol)
  for value in ("-1", "nan"):
    code, err = _cli(["compare", trained, trained, "--atol", value], capsys)
    assert code == 2 and "must be a finite number >= 0" in err


# --- 8. overrides anywhere; files with the user's umask ----------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "llama-tiny", "--prompt", "a=b", "steps=3", "--seed", "1", "seed=7"],
        ["generate", "steps=3", "--prompt", "a=b", "llama-tiny", "--seed", "1", "seed=7"],
        ["generate", "--seed", "1", "steps=3", "seed=7", "llama-tiny", "--prompt", "a=b"],
    ],
)
def test_overrides_are_accepted_anywhere_on_the_command_line(argv):
  args = cli.parse_args(argv)
  assert (args.source, args.prompt, args.seed, args.overrides) == ("llama-tiny", "a=b", 1, ["steps=3", "seed=7"])


def test_files_are_written_with_the_users_umask(trained, tmp_path):
  previous = os.umask(0o002)
  try:
    pretrained.export_hf(trained, tmp_path / "exported")
    converters.convert(trained, tmp_path / "converted" / "checkpoints", layout="nnx")
    mb.load_config("llama-tiny").to_yaml(tmp_path / "config.yml")
  finally:
    os.umask(previous)
  written = [tmp_path / "config.yml", *(tmp_path / "exported").rglob("*"), *(tmp_path / "converted").rglob("*")]
  wrong = {
      str(p): oct(p.stat().st_mode & 0o777)
      for p in written
      if p.stat().st_mode & 0o777 != (0o775 if p.is_dir() else 0o664)
  }
  assert not wrong, f"modes other than 0o775 (folders) / 0o664 (files) under umask 002: {wrong}"


# --- a resume that would change what a run's checkpoints mean ----------------------------------


@pytest.mark.parametrize(
    "started, resumed, named",
    [
        (dict(lora_rank=4, lora_alpha=8.0), dict(lora_rank=4, lora_alpha=64.0), "lora_alpha: 8.0 -> 64.0"),
        (dict(lora_rank=4, lora_alpha=8.0), dict(lora_rank=0), "lora_rank: 4 -> 0"),
        ({}, dict(scan_layers=False), "scan_layers: True -> False"),
        ({}, dict(dataset_type="synthetic"), "dataset_type: 'embedded' -> 'synthetic'"),
    ],
    ids=["lora-alpha", "lora-off", "scan-layers", "data"],
)
def test_a_resume_that_changes_how_checkpoints_read_is_refused_naming_the_key(tmp_path, started, resumed, named):
  _train(tmp_path, "fixed", until_step=1, **started)
  run_dir = tmp_path / "fixed"
  before = {name: (run_dir / name).read_bytes() for name in ("config.yml", "metrics.jsonl")}
  with pytest.raises(
      checkpointing.CheckpointError,
      match=rf"cannot resume with other values of keys fixed when it started \({re.escape(named)}[;)]",
  ):
    _train(tmp_path, "fixed", **resumed)
  assert {name: (run_dir / name).read_bytes() for name in before} == before, "the refused resume rewrote the run"
  _train(tmp_path, "fixed", **started)  # the run's own values resume it


@pytest.mark.parametrize(
    "resumed, named",
    [
        (dict(rope_max_timescale=500000), "rope_max_timescale: 10000 -> 500000"),
        (dict(normalization_layer_epsilon=1e-3), "normalization_layer_epsilon: 1e-05 -> 0.001"),
        (dict(head_dim=32), "head_dim: 16 -> 32"),  # named, not a list of paths whose shapes differ
        (dict(logits_via_embedding=True), "logits_via_embedding: False -> True"),
        (dict(opt_type="muon"), "opt_type: 'adamw' -> 'muon'"),
    ],
    ids=["rope", "epsilon", "head-dim", "tied-head", "optimizer"],
)
def test_a_resume_that_changes_what_the_model_computes_is_refused_naming_the_key(trained, tmp_path, resumed, named):
  # Readers rebuild the model from config.yml, which keeps the run's first values: such a resume would train one
  # model and export another.
  run = _copy(trained, tmp_path)
  before = _snapshot(run)
  with pytest.raises(checkpointing.CheckpointError, match=rf"fixed when it started \({re.escape(named)}[;)]"):
    _train(tmp_path, **resumed)
  assert _snapshot(run) == before


def test_a_resume_appends_its_changes_to_the_config_history_and_keeps_config_yml(trained, tmp_path):
  run_dir = _copy(trained, tmp_path)
  started = (run_dir / "config.yml").read_bytes()
  _train(tmp_path, steps=4, learning_rate=1e-4, until_step=3)
  _train(tmp_path, steps=4, learning_rate=1e-4)  # the same values again: nothing new to record
  _train(tmp_path, steps=5, learning_rate=1e-4, log_period=2)
  assert (run_dir / "config.yml").read_bytes() == started, "a resume rewrote config.yml"
  history = [json.loads(line) for line in (run_dir / "config_history.jsonl").read_text().splitlines()]
  assert [(entry["step"], entry["changed"]) for entry in history] == [
      (2, {"learning_rate": [yaml.safe_load(started)["learning_rate"], 1e-4], "steps": [3, 4]}),
      (4, {"log_period": [yaml.safe_load(started)["log_period"], 2], "steps": [4, 5]}),
  ]
  latest = loop.latest_config(run_dir)
  assert (latest["steps"], latest["learning_rate"], latest["log_period"]) == (5, 1e-4, 2)


def test_a_dpo_resume_on_other_reference_values_at_the_same_path_is_refused(tmp_path):
  """The path is fixed (`load_parameters_path`); the values it holds are checked by fingerprint."""
  for seed, name in ((1, "a"), (2, "b")):
    _train(tmp_path, name, steps=1, seed=seed)
  reference = tmp_path / "reference"
  shutil.copytree(tmp_path / "a" / "checkpoints", reference)
  dpo = dict(use_dpo=True, load_parameters_path=str(reference / "1" / "items"), steps=2)
  _train(tmp_path, "dpo", until_step=1, **dpo)
  assert json.loads((tmp_path / "dpo" / hooks.REFERENCE_FILE).read_text())["base"] == dpo["load_parameters_path"]
  shutil.rmtree(reference)
  shutil.copytree(tmp_path / "b" / "checkpoints", reference)  # other values under the same path
  before = _snapshot(tmp_path / "dpo")
  with pytest.raises(checkpointing.CheckpointError, match=r"its reference model was .*reference/1/items .* not "):
    _train(tmp_path, "dpo", **dpo)
  assert _snapshot(tmp_path / "dpo") == before
  shutil.rmtree(reference)
  shutil.copytree(tmp_path / "a" / "checkpoints", reference)
  _train(tmp_path, "dpo", **dpo)  # its own reference resumes it
