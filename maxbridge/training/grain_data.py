"""Pre-training data through Grain: corpora larger than memory, read lazily, shuffled, tokenized and packed.

`dataset_type: grain` (MaxText's name) reads `grain_train_files` (a file, folder or glob)
of `grain_file_type` records: JSONL lines, plain text files (one document each), Parquet
rows, ArrayRecord records (JSON objects, as `maxbridge data convert` writes them) or the
Arrow files of a Hugging Face `datasets` folder saved with `save_to_disk`. The text is
the `data_columns` field of each record.

The pipeline, per process (each reads only its share of the documents):

    documents [process_index::process_count] -> global shuffle (seed, a new order each
    epoch) -> repeat -> tokenize (`tokenizer_path`'s tokenizer.json, else bytes;
    add_bos/add_eos) -> [grain_worker_count worker processes] -> pack -> batch

Packing is `data.pack`'s policy, done as a stream (`PackIterDataset`): documents follow
one another, a document cut at a row's end continues in the next row as a new segment
whose positions restart at 0, and only the last row of a finite stream is padded. Grain's
own `ConcatThenSplitIterDataset` differs (a cut document's positions continue, and full
documents may jump ahead of the buffer), so the batches would not match the in-memory
path's; ours is small and keeps them equal. It runs after the worker processes, so the
batches are the same for any grain_worker_count.

The iterator's state (a few integers per worker) is saved with each checkpoint through
Grain's orbax handler, so a resumed run reads exactly the batches an uninterrupted one
would have; a resume whose data settings differ is refused, naming the key.
"""

from __future__ import annotations

import bisect
import functools
import glob
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grain
import numpy as np
from absl import flags

from maxbridge.core.checkpointing import CheckpointError
from maxbridge.core.config import Config

# `maxbridge.interop.pretrained` (orbax, for its checks) is imported where it checks: Grain's worker processes
# import this module to run its sources and `Tokenize`, and start sooner without it.

FILE_TYPES = ("auto", "jsonl", "text", "parquet", "arrayrecord", "arrow")
SUFFIXES = {
    ".jsonl": "jsonl",
    ".txt": "text",
    ".parquet": "parquet",
    ".arrayrecord": "arrayrecord",
    ".array_record": "arrayrecord",
    ".arrow": "arrow",
}
BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
# Every EVAL_EVERY-th document is held out for eval when no grain_eval_files are given (as `data.EVAL_EVERY`).
EVAL_EVERY = 20
# The settings a saved iterator state belongs to: resuming with another value would read other batches.
STATE_KEYS = (
    "dataset_type",
    "grain_train_files",
    "grain_eval_files",
    "grain_file_type",
    "data_columns",
    "tokenizer_path",
    "add_bos",
    "add_eos",
    "max_target_length",
    "seed",
    # The batches are the same for any worker count, but the saved state holds one entry per worker.
    "grain_worker_count",
)
_READ_CHUNK = 1 << 22  # bytes scanned at a time when indexing a JSONL file
_PARQUET_GROUPS = 4  # row groups a Parquet source keeps decoded


# --- files -------------------------------------------------------------------------


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


def _text_of(record: Any, column: str, where: str) -> str:
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object with a string {column!r} field, got {type(record).__name__}")
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
    raise ValueError(
        f"{path}: not UTF-8 text at byte offset {offset + e.start}; the corpus must be UTF-8 "
        "(re-encode the file, e.g. with iconv -t UTF-8)"
    ) from e


class _JsonlSource:
  """One JSONL file, one record per non-empty line, read by seeking: its index holds 12 bytes per line."""

  def __init__(self, path: str, column: str):
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
    # A positional read: Grain's reader threads share the file.
    return _decode(os.pread(self._file.fileno(), int(self.lengths[index]), start), self.path, start), start

  def __getitem__(self, index: int) -> str:
    line, start = self.line(index)
    if not line.strip():
      return ""
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{self.path}: byte offset {start}: not valid JSON ({e.msg})") from e
    return _text_of(record, self.column, f"{self.path}: byte offset {start}")


class _TextSource:
  """Plain text files, each one document (as `dataset_type: text` reads them)."""

  def __init__(self, paths: list[str]):
    self.paths = paths

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, index: int) -> str:
    return _decode(Path(self.paths[index]).read_bytes(), self.paths[index], 0)


class _ArrayRecordSource:
  """One ArrayRecord file of JSON objects (what `maxbridge data convert` writes)."""

  def __init__(self, path: str, column: str):
    self.path, self.column = path, column
    self.records = grain.sources.ArrayRecordDataSource([path])

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, index: int) -> str:
    text = _decode(self.records[index], self.path, 0)
    where = f"{self.path}: record {index}"
    try:
      record = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: not a JSON object ({e.msg}); write ArrayRecord with `maxbridge data convert`") from e
    return _text_of(record, self.column, where)


class _ParquetSource:
  """One Parquet file's `column`, read a row group at a time (the last few kept).

  A global shuffle visits row groups at random: a large file reads much more than it
  uses. Convert it to ArrayRecord (`maxbridge data convert`) for large corpora.
  """

  def __init__(self, path: str, column: str):
    import pyarrow.parquet as pq  # only Parquet corpora need it

    self.path, self.column = path, column
    meta = pq.ParquetFile(path).metadata
    names = meta.schema.names
    if column not in names:
      raise ValueError(f"{path}: has no column {column!r} (data_columns); it has {names[:10]}: set data_columns to one")
    self.offsets = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
    self._file, self._groups = None, {}

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getstate__(self):
    return {**self.__dict__, "_file": None, "_groups": {}}

  def _group(self, group: int) -> list:
    if group not in self._groups:
      import pyarrow.parquet as pq

      if self._file is None:
        self._file = pq.ParquetFile(self.path)
      if len(self._groups) >= _PARQUET_GROUPS:
        self._groups.pop(next(iter(self._groups)))  # the oldest
      self._groups[group] = self._file.read_row_group(group, columns=[self.column]).column(0).to_pylist()
    return self._groups[group]

  def __getitem__(self, index: int) -> str:
    group = int(np.searchsorted(self.offsets, index, side="right")) - 1
    text = self._group(group)[index - self.offsets[group]]
    if not isinstance(text, str):
      raise ValueError(f"{self.path}: row {index}: column {self.column!r} holds {type(text).__name__}, not text")
    return text


class _ArrowSource:
  """One Arrow IPC stream file of a `datasets` save_to_disk folder, memory-mapped."""

  def __init__(self, path: str, column: str):
    self.path, self.column = path, column
    table = self._table()
    if column not in table.column_names:
      raise ValueError(
          f"{path}: has no column {column!r} (data_columns); it has {table.column_names[:10]}: set data_columns to one"
      )
    self.length = table.num_rows
    self._column = None

  def _table(self):
    import pyarrow as pa

    return pa.ipc.open_stream(pa.memory_map(self.path)).read_all()

  def __len__(self) -> int:
    return self.length

  def __getstate__(self):
    return {**self.__dict__, "_column": None}

  def __getitem__(self, index: int) -> str:
    if self._column is None:
      self._column = self._table().column(self.column)
    text = self._column[index].as_py()
    if not isinstance(text, str):
      raise ValueError(f"{self.path}: row {index}: column {self.column!r} holds {type(text).__name__}, not text")
    return text


class Corpus:
  """The records of several files as one random-access source of texts (a Grain data source)."""

  def __init__(self, files: list[tuple[str, str]], column: str):
    sources = []
    texts = [path for path, kind in files if kind == "text"]
    for path, kind in files:
      if kind == "text":
        if os.path.getsize(path) == 0:
          raise ValueError(f"{path}: the file is empty; remove it or give it text")
        continue
      source = {"jsonl": _JsonlSource, "parquet": _ParquetSource, "arrayrecord": _ArrayRecordSource}.get(
          kind, _ArrowSource
      )(path, column)
      if not len(source):
        raise ValueError(f"{path}: the file is empty (no records); remove it or give it records")
      if kind in ("jsonl", "arrayrecord"):
        source[0]  # noqa: B018  (a wrong column is found now, not hours into the run)
      sources.append(source)
    if texts:
      sources.append(_TextSource(texts))
    self.sources = sources
    self.offsets = list(np.cumsum([0] + [len(s) for s in sources]))

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getitem__(self, index: int) -> str:
    k = bisect.bisect_right(self.offsets, index) - 1
    return self.sources[k][index - self.offsets[k]]


class HeldOut:
  """The train or eval documents of a corpus: eval holds every EVAL_EVERY-th, train the rest (as `data`)."""

  def __init__(self, corpus, split: str):
    self.corpus, self.eval = corpus, split == "eval"
    n = len(corpus)
    held = -(-n // EVAL_EVERY)
    self.length = held if self.eval else n - held

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, index: int) -> str:
    # Train's j-th document skips the held-out ones before it: one in every EVAL_EVERY.
    return self.corpus[index * EVAL_EVERY if self.eval else index + index // (EVAL_EVERY - 1) + 1]


# --- tokens --------------------------------------------------------------------------


def special_token(folder: str, name: str) -> int | None:
  """The id of tokenizer_config.json's `name` ("bos_token", "eos_token") in `folder`'s tokenizer, if it names one."""
  settings = Path(folder, "tokenizer_config.json")
  token = json.loads(settings.read_text()).get(name) if settings.is_file() else None
  if isinstance(token, dict):
    token = token.get("content")
  if not isinstance(token, str):
    return None
  from maxbridge.interop import pretrained

  return pretrained.load_tokenizer(folder).token_to_id(token)


class Tokenize(grain.transforms.Map):
  """Text -> int32 token ids: `tokenizer_path`'s tokenizer.json (with BOS/EOS as asked), else UTF-8 bytes."""

  def __init__(self, tokenizer_path: str = "", bos: int | None = None, eos: int | None = None):
    self.tokenizer_path, self.bos, self.eos = tokenizer_path, bos, eos

  @functools.cached_property
  def tokenizer(self):
    from tokenizers import Tokenizer  # checked by `GrainDataset` (pretrained.load_tokenizer) before any worker starts

    return Tokenizer.from_file(str(Path(self.tokenizer_path, "tokenizer.json")))

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "tokenizer"}  # each worker loads its own

  def map(self, text: str) -> np.ndarray:
    if not self.tokenizer_path:
      return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
      return np.zeros(0, np.int32)  # an empty document stays empty: no lone BOS/EOS row pieces
    return np.asarray([self.bos] * (self.bos is not None) + ids + [self.eos] * (self.eos is not None), np.int32)


# --- packing -------------------------------------------------------------------------


def pack_row(pieces: list[np.ndarray], length: int) -> dict[str, np.ndarray]:
  """One row of `length` from document pieces that fit it, each its own segment (as `data.pack`)."""
  used = sum(p.size for p in pieces)
  index = np.arange(length, dtype=np.int32)
  starts = np.zeros(length, bool)
  starts[np.cumsum([0] + [p.size for p in pieces[:-1]])] = True
  real = index < used
  inputs = np.zeros(length, np.int32)
  inputs[:used] = np.concatenate(pieces)
  segment = np.cumsum(starts, dtype=np.int32) * real
  position = (index - np.maximum.accumulate(index * starts)) * real
  has_target = np.zeros(length, bool)
  has_target[:-1] = real[1:] & ~starts[1:]
  targets = np.zeros(length, np.int32)
  targets[:-1] = inputs[1:]
  targets *= has_target
  return {
      "inputs": inputs,
      "targets": targets,
      "inputs_position": position.astype(np.int32),
      "inputs_segmentation": segment,
      "targets_segmentation": (segment * has_target).astype(np.int32),
  }


class PackIterDataset(grain.IterDataset):
  """Token arrays packed into rows of `length` as `data.pack` packs them, as a stream.

  `empty_limit`: that many empty documents in a row is an error (a corpus of empty documents, repeated,
  would never fill a row).
  """

  def __init__(self, parent: grain.IterDataset, length: int, empty_limit: int | None = None):
    super().__init__(parent)
    self.length, self.empty_limit = length, empty_limit

  def __iter__(self):
    return _PackIterator(self._parent.__iter__(), self.length, self.empty_limit)

  def __str__(self) -> str:
    return f"PackIterDataset(length={self.length})"


class _PackIterator(grain.DatasetIterator):
  """Its state is the parent's before the document the next row starts in, and how far into it: small and exact."""

  def __init__(self, parent, length: int, empty_limit: int | None = None):
    super().__init__(parent)
    self.length, self.empty_limit = length, empty_limit
    self._empty = 0  # empty documents read since the last token
    self._document = np.zeros(0, np.int32)
    self._offset = 0
    self._before = parent.get_state()  # the parent's state before `_document` was read

  def __next__(self) -> dict[str, np.ndarray]:
    pieces, filled = [], 0
    while filled < self.length:
      if self._offset == self._document.size:
        before = self._parent.get_state()
        try:
          # A copy: a worker's array lives in shared memory that Grain frees as the iterator moves on.
          document = np.array(next(self._parent), copy=True)
        except StopIteration:
          break
        if document.ndim != 1 or not np.issubdtype(document.dtype, np.integer):
          raise ValueError(f"documents must be 1-D integer token arrays, got shape {document.shape} {document.dtype}")
        self._document, self._offset, self._before = document, 0, before
        self._empty = 0 if document.size else self._empty + 1
        if self.empty_limit and self._empty >= self.empty_limit:
          raise ValueError(
              f"{self._empty} documents in a row hold no tokens: every document of this process's share "
              "is empty; give documents with text (check data_columns)"
          )
        continue
      take = min(self.length - filled, self._document.size - self._offset)
      pieces.append(self._document[self._offset : self._offset + take])
      self._offset += take
      filled += take
    if not filled:
      raise StopIteration
    return pack_row(pieces, self.length)

  def get_state(self) -> dict:
    if self._offset == self._document.size:  # nothing left of the current document: start at the next one
      return {"parent": self._parent.get_state(), "offset": 0}
    return {"parent": self._before, "offset": self._offset}

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state["parent"])
    self._before = state["parent"]
    self._document, self._offset = np.zeros(0, np.int32), 0
    if state["offset"]:
      self._document = np.array(next(self._parent), copy=True)
      self._offset = state["offset"]


# --- the dataset -----------------------------------------------------------------------


class GrainDataset:
  """This process's batches of a Grain pipeline, read in order; `batch(step)` as `data.Dataset.batch` reads them.

  The batches are a pure function of the seed, the step and the process: a step
  that is not the next one restarts the iterator and skips to it (an eval's step
  0, a resume without a saved state); a resume with one (`set_state`) goes on
  from it at once.
  """

  def __init__(
      self,
      config: Config,
      split: str,
      batch_size: int,
      process_index: int = 0,
      process_count: int = 1,
      *,
      num_epochs: int | None = None,
      shuffle: bool = True,
  ):
    if batch_size % process_count:
      raise ValueError(
          f"global batch size {batch_size} is not divisible by process_count={process_count}; "
          "use a batch size that is a multiple of it"
      )
    self.config, self.split = config, split
    self.batch_size, self.process_index, self.process_count = batch_size, process_index, process_count
    self.num_epochs, self.shuffle = num_epochs, shuffle
    self.length = config.max_target_length
    key = "grain_eval_files" if split == "eval" and config.grain_eval_files else "grain_train_files"
    files = getattr(config, key)
    source = Corpus(resolve_files(files, config.grain_file_type, key), config.data_columns)
    if not config.grain_eval_files:
      source = HeldOut(source, split)
    if len(source) < process_count:
      raise ValueError(
          f"{key}={files!r}: {len(source)} {split} document(s) for {process_count} process(es); "
          "each process needs at least one"
      )
    self.documents = source
    bos = eos = None
    if config.tokenizer_path:
      from maxbridge.interop import pretrained

      # The model must have an embedding for every id the tokenizer makes (an error naming both otherwise).
      pretrained.load_tokenizer(config.tokenizer_path, config.vocab_size, key=f"tokenizer_path={config.tokenizer_path!r}")
      bos = special_token(config.tokenizer_path, "bos_token") if config.add_bos else None
      eos = special_token(config.tokenizer_path, "eos_token") if config.add_eos else None
      for key, token in (("add_bos", bos), ("add_eos", eos)):
        if getattr(config, key) and token is None:
          raise ValueError(
              f"{key}=true but tokenizer_path={config.tokenizer_path!r} names no {key[4:]}_token in its "
              f"tokenizer_config.json (or its tokenizer.json lacks that token); set {key}=false"
          )
    elif config.vocab_size < 256:
      raise ValueError(
          f"dataset_type='grain' without tokenizer_path yields byte tokens (0..255) but vocab_size="
          f"{config.vocab_size}; set vocab_size >= 256 or give tokenizer_path"
      )
    self.tokenize = Tokenize(config.tokenizer_path, bos, eos)
    self.name = f"grain {split} ({files})"
    self._iterator = None
    self._next = 0

  stateful = True  # its iterator's state is saved with each checkpoint (`snapshot`, `set_state`)

  @property
  def settings(self) -> dict:
    """What the saved state belongs to; `set_state` refuses another."""
    settings = {key: getattr(self.config, key) for key in STATE_KEYS}
    settings.update(global_batch_size=self.batch_size, process_count=self.process_count, split=self.split)
    return settings

  def dataset(self) -> grain.IterDataset:
    """The pipeline of this process's batches."""
    ds = grain.MapDataset.source(self.documents)[self.process_index :: self.process_count]
    share = len(ds)
    if self.shuffle:
      ds = ds.shuffle(seed=self.config.seed)
    ds = ds.repeat(self.num_epochs).map(self.tokenize)
    # A few threads read ahead of the step; the queue bounds memory (documents, not the corpus).
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))
    # Eval restarts at its step 0 every time: worker processes would start again each time too.
    if self.config.grain_worker_count and self.split == "train":
      if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; a library caller never parsed any
        flags.FLAGS.mark_as_parsed()
      it = it.mp_prefetch(
          grain.MultiprocessingOptions(num_workers=self.config.grain_worker_count), worker_init_fn=_die_with_parent
      )
    # An epoch of empty documents would never fill a row: an error, not a hang.
    rows = PackIterDataset(it, self.length, empty_limit=share)
    return rows.batch(self.batch_size // self.process_count, drop_remainder=self.num_epochs is None)

  def _restart(self) -> None:
    self.close()
    self._iterator, self._next = iter(self.dataset()), 0

  def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
    """This process's rows of `step` (per-process pipelines: the processes' slices concatenate to the global batch)."""
    if (process_index, process_count) != (self.process_index, self.process_count):
      raise ValueError(
          f"{self.name} was built for process {self.process_index} of {self.process_count}, "
          f"asked for process {process_index} of {process_count}"
      )
    if step < 0:
      raise ValueError(f"{self.name}: step must be >= 0, got {step}")
    if self._iterator is None or step < self._next:
      self._restart()
    while self._next < step:
      next(self._iterator)
      self._next += 1
    rows = next(self._iterator)
    self._next += 1
    return rows

  def get_state(self) -> dict:
    """The iterator's state before the next step's batch, with the settings it belongs to (JSON)."""
    if self._iterator is None:
      self._restart()
    return {"step": self._next, "settings": self.settings, "iterator": self._iterator.get_state()}

  def snapshot(self) -> Snapshot:
    """The state now, frozen for a checkpoint (Grain's handler reads it from another thread, later)."""
    return Snapshot(self.get_state())

  def set_state(self, state: dict | bytes) -> None:
    """Goes on from a saved state (or its JSON bytes, as Grain's checkpoint handler gives it); refuses one saved
    with other data settings, naming the key."""
    if isinstance(state, bytes):
      state = json.loads(state)
    changed = [
        f"{key}: {state['settings'].get(key)!r} -> {value!r}"
        for key, value in self.settings.items()
        if state["settings"].get(key) != value
    ]
    if changed:
      raise CheckpointError(
          f"{self.name}: the checkpoint's data iterator was saved with other data settings ({'; '.join(changed)}); "
          "resume with the values it was saved with, or start a new run_name"
      )
    self._restart()
    self._iterator.set_state(state["iterator"])
    self._next = state["step"]

  def start_prefetch(self) -> None:
    """Grain's handler calls this after `set_state`; the next `batch` reads ahead by itself."""

  def close(self) -> None:
    """Stops the worker processes, if any."""
    if self._iterator is not None and hasattr(self._iterator, "close"):
      self._iterator.close()
    self._iterator = None

  def __repr__(self) -> str:
    return f"GrainDataset({self.name}, length={self.length}, batch_size={self.batch_size})"


def _die_with_parent(worker_index: int, worker_count: int) -> None:
  """Grain's workers outlive a training process killed with SIGKILL (holding its pipes, so a caller waiting on
  its output waits for ever): on Linux, ask the kernel to kill each worker when its parent dies."""
  del worker_index, worker_count
  if sys.platform.startswith("linux"):
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the request: go now
      os._exit(1)


class Snapshot:
  """A data iterator's state, frozen when a checkpoint starts: Grain's handler writes it whenever orbax gets to it.

  Its state is JSON bytes: the form Grain's handler takes from an iterator that is not one of its own.
  """

  def __init__(self, state: dict):
    self.state = json.dumps(state, indent=1).encode()

  def get_state(self) -> bytes:
    return self.state


# --- tools: `maxbridge data inspect` and `maxbridge data convert` ----------------------


def inspect(config: Config, batches: int = 2, rows: int = 3, width: int = 160) -> str:
  """A report of the first `batches` training batches of `config`: document counts, tokens, padding, decoded rows."""
  if batches < 1:
    raise ValueError(f"inspect reads at least 1 batch, got {batches}")
  dataset = GrainDataset(config, "train", config.per_device_batch_size)
  held = GrainDataset(config, "eval", config.per_device_batch_size).documents if not config.grain_eval_files else None
  try:
    sample = [dataset.batch(step) for step in range(batches)]
  finally:
    dataset.close()
  segments = np.concatenate([b["inputs_segmentation"] for b in sample])
  real = int((segments > 0).sum())
  lines = [
      f"{dataset.name}: {len(dataset.documents)} training documents"
      + (f", {len(held)} held out for eval (every {EVAL_EVERY}th)" if held is not None else ""),
      f"tokenizer: {config.tokenizer_path or 'bytes'}; rows of {dataset.length} tokens",
      f"first {batches} batch(es): {segments.shape[0]} rows, {real} tokens, padding {1 - real / segments.size:.2%}",
  ]
  inputs = np.concatenate([b["inputs"] for b in sample])
  for r in range(min(rows, inputs.shape[0])):
    pieces = []
    for segment in range(1, int(segments[r].max()) + 1):
      tokens = inputs[r][segments[r] == segment]
      if config.tokenizer_path:
        pieces.append(dataset.tokenize.tokenizer.decode(tokens.tolist(), skip_special_tokens=False))
      else:
        pieces.append(tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace"))
    text = " | ".join(pieces)  # segments (documents or their pieces) apart
    lines.append(f"row {r}: {text[:width]!r}" + (" ..." if len(text) > width else ""))
  return "\n".join(lines)


def convert(source: str, destination: str, progress: bool = True) -> list[str]:
  """Writes the records of `source` (a JSONL, Parquet or text file, folder or glob) as ArrayRecord, one
  `<name>.arrayrecord` per file in the new folder `destination`, each record a JSON object; returns the files.

  The folder appears whole or not at all: it is written under a temporary name and renamed.
  """
  import shutil

  import pyarrow.parquet as pq
  from array_record.python.array_record_module import ArrayRecordWriter
  from tqdm import tqdm

  files = resolve_files(source, key="SRC")
  if os.path.exists(destination):
    raise ValueError(f"DST {destination!r} exists; give a new folder (convert never overwrites)")
  bad = [path for path, kind in files if kind not in ("jsonl", "parquet", "text")]
  if bad:
    raise ValueError(f"{bad[0]}: convert reads JSONL, Parquet or text files, not {dict(files)[bad[0]]}")
  stems = [Path(path).stem for path, _ in files]
  if len(set(stems)) != len(stems):
    raise ValueError(f"SRC {source!r} holds several files named alike ({stems}); convert them one folder at a time")
  temporary = f"{destination}.tmp-{os.getpid()}"
  os.makedirs(temporary)
  written = []
  try:
    for path, kind in files:
      target = os.path.join(temporary, Path(path).stem + ".arrayrecord")
      # group_size:1 keeps each record its own chunk: a shuffled read decodes only what it uses.
      writer = ArrayRecordWriter(target, "group_size:1")
      try:
        if kind == "jsonl":
          lines = _JsonlSource(path, column="")
          records = (_json_line(lines, i) for i in range(len(lines)))
          total = len(lines)
        elif kind == "parquet":
          table = pq.ParquetFile(path)
          total = table.metadata.num_rows
          records = (
              json.dumps(row, ensure_ascii=False, default=str).encode()
              for batch in table.iter_batches()
              for row in batch.to_pylist()
          )
        else:
          total = 1
          records = iter([json.dumps({"text": _TextSource([path])[0]}, ensure_ascii=False).encode()])
        if not total:
          raise ValueError(f"{path}: the file is empty (no records); remove it or give it records")
        for record in tqdm(records, total=total, desc=Path(path).name, unit="rec", disable=not progress):
          writer.write(record)
      finally:
        writer.close()
      written.append(os.path.join(destination, Path(target).name))
    os.rename(temporary, destination)
  except BaseException:
    shutil.rmtree(temporary, ignore_errors=True)
    raise
  return written


def _json_line(lines: _JsonlSource, index: int) -> bytes:
  text, start = lines.line(index)
  try:
    json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{lines.path}: byte offset {start}: not valid JSON ({e.msg})") from e
  return text.strip().encode()
