"""One writer per run folder: `files.run_lock`, across processes and kill -9."""

import os
import signal
import subprocess
import sys

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
