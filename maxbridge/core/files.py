"""Writing files the safe way: atomically, with the user's umask, and cleaning up after killed runs.

Pure Python (no jax), like `maxbridge.config`, which writes through it.

Temporary folders are named `.<destination name>.<tag>-<host>-<pid>-<random>`
beside their destination, so a later run for the same destination can prove
a leftover is its own (same name, same host, a process that no longer exists)
and remove it; one of a live process, or of another host, is never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Iterator


def umask() -> int:
  """The process's umask (read without changing it where /proc allows)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def apply_umask(path: str | os.PathLike, directory: bool) -> None:
  """Gives `path` the mode a plain open()/mkdir() would: 0o666 or 0o777 less the umask.

  `tempfile` creates 0o600 files and 0o700 folders; once renamed into place they
  would hide a shared run from the user's teammates.
  """
  os.chmod(path, (0o777 if directory else 0o666) & ~umask())


def write_text(path: str | os.PathLike, text: str) -> None:
  """Writes `path` atomically: a reader sees the old file or the new one, never half of one."""
  path = Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
    apply_umask(tmp, directory=False)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def _host() -> str:
  return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:32] or "host"


def temp_dir_beside(destination: str | os.PathLike, tag: str) -> Path:
  """A new, empty folder beside `destination` for staging it; removes stale ones of earlier runs first."""
  destination = Path(destination)
  remove_stale_temps(destination, tag)
  tmp = Path(tempfile.mkdtemp(dir=destination.parent, prefix=f".{destination.name}.{tag}-{_host()}-{os.getpid()}-"))
  apply_umask(tmp, directory=True)
  return tmp


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # someone else's process
  return True


def remove_stale_temps(destination: str | os.PathLike, tag: str) -> list[Path]:
  """Removes the temporary folders a killed run for `destination` left: same tag, this host, dead pid."""
  destination = Path(destination)
  pattern = re.compile(rf"\.{re.escape(destination.name)}\.{re.escape(tag)}-{re.escape(_host())}-(\d+)-[^/]*")
  removed = []
  try:
    entries = list(destination.parent.iterdir())
  except OSError:
    return removed
  for entry in entries:
    match = pattern.fullmatch(entry.name)
    if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
      shutil.rmtree(entry, ignore_errors=True)
      removed.append(entry)
      print(f"maxbridge: removed {entry}, left by a killed run (pid {match.group(1)})", file=sys.stderr)
  return removed


class RunInUse(ValueError):
  """Another process is writing the run folder: a second writer would interleave its history with the first's."""


def lock_path(run_dir: str | os.PathLike) -> Path:
  """The lock file of a run folder: beside it, so that a run that fails before it starts leaves no folder."""
  run_dir = Path(run_dir)
  return run_dir.parent / f".{run_dir.name}.lock"


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike) -> Iterator[None]:
  """Holds the one writer's lock of `run_dir` for the block, or raises `RunInUse` naming the holder's pid.

  An exclusive `flock`: the kernel releases it when its holder dies, kill -9
  included, so a lock file left by a killed run is no obstacle. The holder
  removes the file as it leaves; whoever locked a file that was removed
  meanwhile locks the new one instead, so two processes never both hold it.
  Readers (generate, export-hf, convert, compare) never take it.
  """
  path = lock_path(run_dir)
  made = None if path.parent.exists() else path.parent
  path.parent.mkdir(parents=True, exist_ok=True)
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      raise RunInUse(
          f"{Path(run_dir)} is being written by another process (pid {holder}); a run folder takes one writer "
          "at a time: wait for it to finish, or choose another run_name"
      ) from None
    try:
      if os.stat(path).st_ino == os.fstat(fd).st_ino:
        break
    except FileNotFoundError:
      pass
    os.close(fd)  # the holder we waited for removed this file: lock the one now there
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    yield
  finally:
    os.unlink(path)  # while still locked: a process that opened it meanwhile sees it gone, and retries
    os.close(fd)
    if made is not None:
      with contextlib.suppress(OSError):  # a new base folder that nothing else was written into
        made.rmdir()


def set_aside(run_dir: str | os.PathLike, keep: str | os.PathLike) -> Path:
  """Moves what an attempt left in `run_dir` (its metrics, config, features' files), all but `keep`, into the next
  `run_dir/aborted/N` (1, 2, ...): a new attempt starts clean, and nothing of the old one is lost or mixed in."""
  run_dir, keep = Path(run_dir), Path(keep)
  parent = run_dir / "aborted"
  taken = [int(p.name) for p in parent.iterdir() if p.name.isdigit()] if parent.is_dir() else []
  aside = parent / str(max(taken, default=0) + 1)
  aside.mkdir(parents=True)
  for entry in run_dir.iterdir():
    if entry not in (keep, parent):
      entry.rename(aside / entry.name)  # one rename each, on the same file system: never half-copied
  return aside
