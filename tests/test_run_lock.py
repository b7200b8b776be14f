"""One writer per run folder: `files.run_lock`, across processes and kill -9, and `maxbridge train` holding it."""

import json
import os
import signal
import subprocess
import sys
import threading
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


def test_sigterm_while_the_first_step_compiles_ends_the_process_at_once_and_the_run_starts_again(tmp_path):
  """A scheduler's SIGTERM is not held through the first compile (its grace period would run out first); the
  run has written nothing yet, so the same command then trains from step 0."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # a cached compile is instant
  env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
  # Unrolled layers: a first step that compiles for tens of seconds on this machine.
  args = _train_args(tmp_path, steps=2, scan_layers="false", base_num_decoder_layers=12, **LINEN)
  proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE)
  err = bytearray()
  threading.Thread(target=_read_into, args=(proc.stderr, err), daemon=True).start()
  try:
    deadline = time.monotonic() + 240
    while b"0/2" not in err:  # the progress bar: the loop is about to build (compile) its first step
      assert proc.poll() is None and time.monotonic() < deadline, err.decode()[-3000:]
      time.sleep(0.1)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    proc.wait(timeout=60)
    took = time.monotonic() - sent
  finally:
    proc.kill()
  assert proc.returncode == -signal.SIGTERM, err.decode()[-3000:]
  assert took < 5, f"ended {took:.1f} s after SIGTERM"
  run_dir = tmp_path / "same"
  assert not (run_dir / "config.yml").exists() and not (run_dir / "metrics.jsonl").exists()
  again = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def _read_into(stream, buffer: bytearray) -> None:
  while chunk := stream.read1(4096):
    buffer.extend(chunk)
