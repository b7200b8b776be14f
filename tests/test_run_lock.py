"""One writer per run folder: `files.run_lock`, across processes and kill -9, and `maxbridge train` holding it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxbridge.core import files

HOLD = """
import sys, time
from maxbridge.core import files
with files.run_lock(sys.argv[1]):
  print("locked", flush=True)
  time.sleep(600)
"""


def _holder(run_dir) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_a_second_writer_is_refused_naming_the_folder_and_the_holders_pid(tmp_path):
  run_dir = tmp_path / "runs" / "demo"
  holder = _holder(run_dir)
  try:
    with pytest.raises(files.RunInUse, match=rf"{run_dir} is being written by another process \(pid {holder.pid}\)"):
      with files.run_lock(run_dir):
        pass
  finally:
    holder.kill()
    holder.wait()


def test_the_lock_of_a_writer_killed_with_sigkill_is_taken_by_the_next(tmp_path):
  run_dir = tmp_path / "demo"
  holder = _holder(run_dir)
  os.kill(holder.pid, signal.SIGKILL)
  holder.wait()
  assert files.lock_path(run_dir).exists(), "a killed holder cannot remove its file"
  with files.run_lock(run_dir):
    assert files.lock_path(run_dir).read_text() == f"{os.getpid()}\n"
  assert not files.lock_path(run_dir).exists()


def test_a_released_lock_leaves_nothing_behind(tmp_path):
  with files.run_lock(tmp_path / "new_base" / "demo"):
    assert (tmp_path / "new_base").is_dir()
  assert list(tmp_path.iterdir()) == [], "neither the lock file nor the base folder made for it stays"


def test_locks_of_different_runs_do_not_exclude_each_other(tmp_path):
  with files.run_lock(tmp_path / "a"), files.run_lock(tmp_path / "b"):
    pass


REPO = Path(__file__).resolve().parent.parent
LINEN = dict(pure_nnx=False, enable_nnx=False, pure_nnx_decoder=False)
NNX = dict(pure_nnx=True, enable_nnx=True, pure_nnx_decoder=True)


def _train_args(tmp_path, **overrides) -> list[str]:
  values = dict(
      base_output_directory=tmp_path, run_name="same", per_device_batch_size=2, checkpoint_period=2, eval_interval=0
  )
  return [
      sys.executable,
      "-m",
      "maxbridge.cli",
      "train",
      "llama-tiny",
      *(f"{k}={v}" for k, v in {**values, **overrides}.items()),
  ]


def test_a_second_trainer_of_a_run_exits_2_at_once_and_the_run_keeps_the_first_ones_history(tmp_path):
  env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  run_dir = tmp_path / "same"
  first = subprocess.Popen(_train_args(tmp_path, steps=100_000, **LINEN), env=env, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "2" / "items" / "_METADATA").exists():
      assert first.poll() is None, first.stderr.read()[-3000:]
      assert time.monotonic() < deadline, "no checkpoint in time"
      time.sleep(0.2)
    began = time.monotonic()
    second = subprocess.run(_train_args(tmp_path, steps=6, **NNX), env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"{run_dir} is being written by another process (pid {first.pid})" in second.stderr
    assert time.monotonic() - began < 60
    # Readers take no lock: they read the committed steps while the trainer writes.
    reader = [sys.executable, "-m", "maxbridge.cli", "generate", str(run_dir), "--prompt", "hi", "--max-new-tokens", "2"]
    read = subprocess.run(reader, env=env, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0 and read.stdout.startswith("hi"), read.stderr[-3000:]
    assert first.poll() is None, "the first trainer goes on"
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=60)
  finally:
    first.kill()
  assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
  # What one trainer leaves: its config, its whole history from step 0, its checkpoints; and no lock.
  assert "pure_nnx: false" in (run_dir / "config.yml").read_text()
  steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert steps == list(range(len(steps))) and len(steps) >= 2, steps
  saved = [int(step.name) for step in (run_dir / "checkpoints").iterdir() if (step / "items" / "_METADATA").exists()]
  assert saved and max(saved) <= len(steps), saved
  assert not files.lock_path(run_dir).exists()
