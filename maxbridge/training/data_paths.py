"""A run's data files as a resume compares them: path keys by what they name (a resume's check of its data keys,
in `loop`, `grain_data` and offline distillation logits, takes 'corpus.jsonl' read from /data for
'/data/corpus.jsonl'), and each file by a `fingerprint` of its contents (changed in place since a checkpoint).

The standard library only: `data` (numpy only) and `grain_data` both read it.
"""

from __future__ import annotations

import hashlib
import os

# The data keys that name files, folders or globs: a resume compares where they point (`same_setting`), not how
# they are spelled ('corpus.jsonl' from /data is '/data/corpus.jsonl').
PATH_KEYS = ("dataset_path", "tokenizer_path", "grain_train_files", "grain_eval_files")


def resolved(path: str) -> str:
  """A path key's value as what it names from here: absolute, with `~`, `..` and symlinks resolved ('' stays)."""
  return os.path.realpath(os.path.expanduser(path)) if path else path


def same_setting(key: str, saved, now) -> bool:
  """Whether a resume's value of `key` is the one its run recorded: path keys compared `resolved` (a relative
  path recorded by a run is read from the resume's folder, as the resume reads it)."""
  if key in PATH_KEYS and isinstance(saved, str) and isinstance(now, str):
    return resolved(saved) == resolved(now)
  return saved == now


# A data file's fingerprint reads its first and last _EDGE bytes and _SAMPLES blocks of _SAMPLE bytes between:
# files are rewritten whole (a new header, footer or index at their ends) or appended to (a new size), and a
# fingerprint that read every byte of a terabyte corpus at each start would take longer than the steps it checks.
_EDGE = 1 << 16
_SAMPLES, _SAMPLE = 16, 1 << 12


def fingerprint(path: str) -> str:
  """The file's size and a sha256 of its two ends and 16 blocks between, as "<size>:<16 hex digits>": of every
  byte for files under about 200 KB; in larger ones an edit that keeps the size and misses the bytes read goes
  unseen."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size <= 2 * _EDGE + _SAMPLES * _SAMPLE:
      digest.update(f.read())
    else:
      step = (size - 2 * _EDGE) // (_SAMPLES + 1)
      for offset in (0, *(_EDGE + step * (i + 1) for i in range(_SAMPLES)), size - _EDGE):
        digest.update(os.pread(f.fileno(), _EDGE if offset in (0, size - _EDGE) else _SAMPLE, offset))
  return f"{size}:{digest.hexdigest()[:16]}"
