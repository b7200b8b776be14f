"""The records of a corpus for Grain, read lazily: files, their formats, and the held-out split.

A source is random access (a Grain data source): `Corpus[i]` is the i-th record of
the files `resolve_files` names, in order. With a `column` it is that field's text
(pre-training); without one, the whole record as a dict (SFT and DPO rows, whose
fields are read by `posttrain.sft` and `posttrain.dpo`). A record that cannot be
read (not UTF-8, not JSON) raises `DamagedRecord` naming its file and offset;
`Corpus(..., skip_damaged=True)` gives a `Damaged` in its place instead, which the
packers skip and count (`grain_skip_damaged_records`). A file its format's reader
cannot parse (truncated, overwritten, bits flipped) raises `DamagedFile` naming it and
the reader's complaint, as it opens or whenever a read hits the damage: never skipped,
since what else of it is wrong cannot be known.

numpy, Grain and pyarrow only: Grain's worker processes import this to read.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import threading
from pathlib import Path
from typing import Any

import grain
import numpy as np

FILE_TYPES = ("auto", "jsonl", "text", "parquet", "arrayrecord", "arrow")
SUFFIXES = {
    ".jsonl": "jsonl",
    ".txt": "text",
    ".parquet": "parquet",
    ".arrayrecord": "arrayrecord",
    ".array_record": "arrayrecord",
    ".arrow": "arrow",
}
# Every EVAL_EVERY-th document is held out for eval when no grain_eval_files are given (as `data.EVAL_EVERY`).
EVAL_EVERY = 20
_READ_CHUNK = 1 << 22  # bytes scanned at a time when indexing a JSONL file
_PARQUET_GROUPS = 4  # row groups a Parquet source keeps decoded
FORMATS = {"jsonl": "JSONL", "text": "text", "parquet": "Parquet", "arrayrecord": "ArrayRecord", "arrow": "Arrow"}


def resolve_files(pattern: str, file_type: str = "auto", key: str = "grain_train_files") -> list[tuple[str, str]]:
  """[(path, file type)] that `pattern` (a file, folder or glob) names, sorted; an error naming `key` if none."""
  if file_type not in FILE_TYPES:
    raise ValueError(f"grain_file_type={file_type!r} is not one of {', '.join(map(repr, FILE_TYPES))}")
  if not pattern:
    raise ValueError(f"{key} is empty: give a file, folder or glob of training files")
  if os.path.isdir(pattern):
    state = Path(pattern, "state.json")
    if state.is_file():  # a Hugging Face `datasets` folder from save_to_disk: its Arrow files, in order
      try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{key}: {state} is not a `datasets` state.json ({type(e).__name__}: {e})") from e
      return [(str(Path(pattern, n)), "arrow") for n in names]
    paths = sorted(str(p) for p in Path(pattern).rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    what = f"{key}={pattern!r} is a folder with no {'/'.join(SUFFIXES)} files"
  else:
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    what = f"{key}={pattern!r} matches no files; give a file, a folder or a glob such as 'corpus/*.jsonl'"
  if not paths:
    raise ValueError(what)
  found = []
  for path in paths:
    kind = file_type if file_type != "auto" else SUFFIXES.get(Path(path).suffix)
    if kind is None:
      raise ValueError(
          f"{path}: grain_file_type='auto' cannot tell its format from its name; name it "
          f"{', '.join(SUFFIXES)} or set grain_file_type to one of {', '.join(FILE_TYPES[1:])}"
      )
    found.append((path, kind))
  return found


class DamagedRecord(ValueError):
  """A record that cannot be read (not UTF-8, not JSON): its file and offset are in the message."""

  def __str__(self) -> str:
    return f"{self.args[0]}; set grain_skip_damaged_records=true to skip such records"


class DamagedFile(ValueError):
  """A data file its format's reader cannot parse (truncated, overwritten, not that format): a bad input (exit 2)."""


def damaged_file(path: str, kind: str, what: str, error: BaseException) -> DamagedFile:
  """The error for `path` (a `kind` file) whose reader raised `error` while reading `what`."""
  detail = str(error).strip() or "no detail given"
  return DamagedFile(
      f"{path}: cannot read {what} as {FORMATS[kind]} ({type(error).__name__}: {detail}); the file is damaged, "
      f"truncated or not {FORMATS[kind]}: replace it (write ArrayRecord again with `maxbridge data convert`)"
  )


# What the readers raise on a file they cannot parse: array_record's RuntimeError ("Corrupted Riegeli/records
# file"), pyarrow's ArrowException (ArrowInvalid is also a ValueError) and OSError (a short read), the OS's OSError.
_READ_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, EOFError)


def read_errors() -> tuple[type[BaseException], ...]:
  try:
    import pyarrow as pa  # only Parquet and Arrow corpora need it
  except ImportError:
    return _READ_ERRORS
  return (*_READ_ERRORS, pa.ArrowException)


class Damaged:
  """What a corpus that skips damaged records gives in place of one; the packers skip and count it."""

  def __init__(self, message: str):
    self.message = message

  def __repr__(self) -> str:
    return f"Damaged({self.message!r})"


def _field(record: Any, column: str | None, where: str):
  """`record`'s text in `column`, or with no column the record itself (a dict) and where it is."""
  if not isinstance(record, dict):
    wanted = f"a string {column!r} field" if column else "fields"
    raise ValueError(f"{where}: expected a JSON object with {wanted}, got {type(record).__name__}")
  if column is None:
    return record, where
  if column not in record:
    raise ValueError(
        f"{where}: has no column {column!r} (data_columns); it has {sorted(record)[:10]}: set data_columns to one"
    )
  text = record[column]
  if not isinstance(text, str):
    raise ValueError(f"{where}: column {column!r} holds {type(text).__name__}, not text")
  return text


def _decode(data: bytes, path: str, offset: int) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DamagedRecord(
        f"{path}: not UTF-8 text at byte offset {offset + e.start}; the corpus must be UTF-8 "
        "(re-encode the file, e.g. with iconv -t UTF-8)"
    ) from e


def _json(text: str, where: str, hint: str = "") -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise DamagedRecord(f"{where}: not valid JSON ({e.msg}){hint}") from e


class JsonlSource:
  """One JSONL file, one record per non-empty line, read by seeking: its index holds 12 bytes per line."""

  def __init__(self, path: str, column: str | None):
    self.path, self.column = path, column
    starts, ends, done = [], [], 0
    with open(path, "rb") as f:
      carry = b""
      while chunk := f.read(_READ_CHUNK):
        buffer = carry + chunk
        newlines = np.flatnonzero(np.frombuffer(buffer, np.uint8) == 10)
        line_starts = np.concatenate([[0], newlines[:-1] + 1]) if newlines.size else np.zeros(0, np.int64)
        starts.append(line_starts + done)
        ends.append(newlines + done)
        cut = int(newlines[-1]) + 1 if newlines.size else 0
        carry, done = buffer[cut:], done + cut
      if carry.strip():
        starts.append(np.array([done])), ends.append(np.array([done + len(carry)]))
    starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    lengths = np.concatenate(ends) - starts if ends else np.zeros(0, np.int64)
    keep = lengths > 0  # an empty line holds no record (a blank one reads as an empty document)
    self.starts, self.lengths = starts[keep].astype(np.int64), lengths[keep].astype(np.int32)
    self._file = None

  def __len__(self) -> int:
    return self.starts.size

  def __getstate__(self):
    return {**self.__dict__, "_file": None}  # worker processes open their own

  def line(self, index: int) -> tuple[str, int]:
    """(the text of line `index`, its byte offset)."""
    if self._file is None:
      self._file = open(self.path, "rb")  # noqa: SIM115  (open while the source lives)
    start = int(self.starts[index])
    try:  # a positional read: Grain's reader threads share the file
      data = os.pread(self._file.fileno(), int(self.lengths[index]), start)
    except OSError as e:
      raise damaged_file(self.path, "jsonl", f"byte offset {start}", e) from e
    if len(data) < self.lengths[index]:  # cut short since it was indexed
      raise DamagedFile(f"{self.path}: ends at byte {start + len(data)}, inside a record it held when the run opened it")
    return _decode(data, self.path, start), start

  def __getitem__(self, index: int):
    line, start = self.line(index)
    if not line.strip():  # a blank line: an empty document, or no row (Grain skips a None)
      return "" if self.column is not None else None
    where = f"{self.path}: byte offset {start}"
    return _field(_json(line, where), self.column, where)


class TextSource:
  """Plain text files, each one document (as `dataset_type: text` reads them)."""

  def __init__(self, paths: list[str]):
    self.paths = paths

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, index: int) -> str:
    try:
      data = Path(self.paths[index]).read_bytes()
    except OSError as e:
      raise damaged_file(self.paths[index], "text", "the file", e) from e
    return _decode(data, self.paths[index], 0)


class _ArrayRecordSource:
  """One ArrayRecord file of JSON objects (what `maxbridge data convert` writes)."""

  def __init__(self, path: str, column: str | None):
    self.path, self.column = path, column
    try:
      self.records = grain.sources.ArrayRecordDataSource([path])
    except _READ_ERRORS as e:
      raise damaged_file(path, "arrayrecord", "its index", e) from e

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int):
    where = f"{self.path}: record {index}"
    try:
      data = self.records[index]
    except _READ_ERRORS as e:
      raise damaged_file(self.path, "arrayrecord", f"record {index}", e) from e
    text = _decode(data, where, 0)
    record = _json(text, where, "; write ArrayRecord with `maxbridge data convert`")
    return _field(record, self.column, where)


class _ParquetSource:
  """One Parquet file's `column` (or its rows), read a row group at a time (the last few kept).

  A global shuffle visits row groups at random: a large file reads much more than it
  uses. Convert it to ArrayRecord (`maxbridge data convert`) for large corpora, or
  shuffle within a window (`grain_shuffle_buffer_size`).
  """

  def __init__(self, path: str, column: str | None):
    import pyarrow.parquet as pq  # only Parquet corpora need it

    self.path, self.column = path, column
    try:
      meta = pq.ParquetFile(path).metadata
    except read_errors() as e:
      raise damaged_file(path, "parquet", "its footer", e) from e
    names = meta.schema.names
    if column is not None and column not in names:
      raise ValueError(f"{path}: has no column {column!r} (data_columns); it has {names[:10]}: set data_columns to one")
    self.offsets = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
    self._file, self._groups = None, {}
    # Grain's prefetch reads records from a thread pool; one pyarrow ParquetFile read from
    # two threads at once crashes the process (seen as a segfault in read_row_group).
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getstate__(self):
    return {**self.__dict__, "_file": None, "_groups": {}, "_lock": None}

  def __setstate__(self, state):
    self.__dict__.update(state, _lock=threading.Lock())

  def _group(self, group: int) -> list:
    with self._lock:
      try:
        return self._read_group(group)
      except (*read_errors(), UnicodeDecodeError) as e:
        raise damaged_file(self.path, "parquet", f"row group {group}", e) from e

  def _read_group(self, group: int) -> list:
    if group not in self._groups:
      import pyarrow.parquet as pq

      if self._file is None:
        self._file = pq.ParquetFile(self.path)
      if len(self._groups) >= _PARQUET_GROUPS:
        self._groups.pop(next(iter(self._groups)))  # the oldest
      if self.column is None:
        self._groups[group] = self._file.read_row_group(group).to_pylist()
      else:
        self._groups[group] = self._file.read_row_group(group, columns=[self.column]).column(0).to_pylist()
    return self._groups[group]

  def __getitem__(self, index: int):
    group = int(np.searchsorted(self.offsets, index, side="right")) - 1
    value = self._group(group)[index - self.offsets[group]]
    where = f"{self.path}: row {index}"
    if self.column is None:
      return _field(value, None, where)
    if not isinstance(value, str):
      raise ValueError(f"{where}: column {self.column!r} holds {type(value).__name__}, not text")
    return value


class _ArrowSource:
  """One Arrow IPC stream file of a `datasets` save_to_disk folder, memory-mapped."""

  def __init__(self, path: str, column: str | None):
    self.path, self.column = path, column
    try:
      table = self._table()
    except read_errors() as e:
      raise damaged_file(path, "arrow", "its record batches", e) from e
    if column is not None and column not in table.column_names:
      raise ValueError(
          f"{path}: has no column {column!r} (data_columns); it has {table.column_names[:10]}: set data_columns to one"
      )
    self.length = table.num_rows
    self._data = None

  def _table(self):
    import pyarrow as pa

    return pa.ipc.open_stream(pa.memory_map(self.path)).read_all()

  def __len__(self) -> int:
    return self.length

  def __getstate__(self):
    return {**self.__dict__, "_data": None}

  def __getitem__(self, index: int):
    if self._data is None:
      try:
        table = self._table()
      except read_errors() as e:
        raise damaged_file(self.path, "arrow", "its record batches", e) from e
      self._data = table if self.column is None else table.column(self.column)
    where = f"{self.path}: row {index}"
    try:
      if self.column is None:
        return _field(self._data.slice(index, 1).to_pylist()[0], None, where)
      text = self._data[index].as_py()
    except UnicodeDecodeError as e:  # a string column's bytes, damaged in place
      raise DamagedRecord(f"{where}: not UTF-8 text at byte {e.start} of the row's {self.column or 'fields'}") from e
    if not isinstance(text, str):
      raise ValueError(f"{where}: column {self.column!r} holds {type(text).__name__}, not text")
    return text


class Corpus:
  """The records of several files as one random-access source (a Grain data source).

  `column`: each record's text in that field; None: each record as (dict, where it is), for SFT and DPO rows.
  `skip_damaged`: a record that cannot be read is a `Damaged`, not an error.
  """

  def __init__(self, files: list[tuple[str, str]], column: str | None, skip_damaged: bool = False):
    sources = []
    texts = [path for path, kind in files if kind == "text"]
    if texts and column is None:
      raise ValueError(
          f"{texts[0]}: SFT and DPO rows are JSON records (JSONL, Parquet, ArrayRecord or Arrow), not text files"
      )
    for path, kind in files:
      if kind == "text":
        if os.path.getsize(path) == 0:
          raise ValueError(f"{path}: the file is empty; remove it or give it text")
        continue
      source = {"jsonl": JsonlSource, "parquet": _ParquetSource, "arrayrecord": _ArrayRecordSource}.get(
          kind, _ArrowSource
      )(path, column)
      if not len(source):
        raise ValueError(f"{path}: the file is empty (no records); remove it or give it records")
      if kind in ("jsonl", "arrayrecord"):
        try:
          source[0]  # a wrong column is found now, not hours into the run
        except DamagedRecord:
          if not skip_damaged:
            raise
      sources.append(source)
    if texts:
      sources.append(TextSource(texts))
    self.sources, self.skip_damaged = sources, skip_damaged
    self.offsets = list(np.cumsum([0] + [len(s) for s in sources]))

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getitem__(self, index: int):
    k = bisect.bisect_right(self.offsets, index) - 1
    try:
      return self.sources[k][index - self.offsets[k]]
    except DamagedRecord as e:
      if not self.skip_damaged:
        raise
      return Damaged(e.args[0])


class HeldOut:
  """The train or eval documents of a corpus: eval holds every EVAL_EVERY-th, train the rest (as `data`)."""

  def __init__(self, corpus, split: str):
    self.corpus, self.eval = corpus, split == "eval"
    n = len(corpus)
    held = -(-n // EVAL_EVERY)
    self.length = held if self.eval else n - held

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, index: int):
    # Train's j-th document skips the held-out ones before it: one in every EVAL_EVERY.
    return self.corpus[index * EVAL_EVERY if self.eval else index + index // (EVAL_EVERY - 1) + 1]
