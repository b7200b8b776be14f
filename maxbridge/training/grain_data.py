"""Training data through Grain: corpora larger than memory, read lazily, shuffled, tokenized and packed.

`dataset_type: grain` (MaxText's name) reads `grain_train_files` (a file, folder or glob)
of `grain_file_type` records: JSONL lines, plain text files (one document each), Parquet
rows, ArrayRecord records (JSON objects, as `maxbridge data convert` writes them) or the
Arrow files of a Hugging Face `datasets` folder saved with `save_to_disk` (`grain_sources`).
For pre-training the text is the `data_columns` field of each record; with `use_sft` each
record is an SFT example (prompt/completion or messages), with `use_dpo` a preference pair
(prompt/chosen/rejected), encoded as the in-memory path encodes them (`posttrain.sft`).

The pipeline, per process (each reads only its share of the records):

    records [process_index::process_count] -> global shuffle (seed, a new order each
    epoch; or within windows of grain_shuffle_buffer_size) -> repeat -> tokenize
    (`tokenizer_path`'s tokenizer.json, else bytes; add_bos/add_eos; SFT/DPO: its chat
    template) -> [grain_worker_count worker processes] -> pack -> batch

Packing is the in-memory path's policy, done as a stream. Pre-training (`PackIterDataset`,
as `data.pack`): documents follow one another, a document cut at a row's end continues in
the next row as a new segment whose positions restart at 0, and only the last row of a
finite stream is padded. Grain's own `ConcatThenSplitIterDataset` differs (a cut document's
positions continue, and full documents may jump ahead of the buffer), so the batches would
not match the in-memory path's; ours is small and keeps them equal. SFT and DPO
(`PackExamplesIterDataset`, as `sft.pack_examples`/`dpo.pack_pairs`): whole examples, a row
padded when the next does not fit. Packing runs after the worker processes, so the batches
are the same for any grain_worker_count.

The iterator's state (a few integers per worker, and the damaged records skipped) is saved
with each checkpoint through Grain's orbax handler, so a resumed run reads exactly the
batches an uninterrupted one would have; a resume whose data settings differ is refused,
naming the key, unless `restart_data_on_resume` starts the new data from its beginning.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path

import grain
import numpy as np
from absl import flags, logging

from maxbridge.core.checkpointing import CheckpointError
from maxbridge.core.config import Config
from maxbridge.training.grain_sources import EVAL_EVERY, Corpus, Damaged, HeldOut, JsonlSource, TextSource, resolve_files

# `maxbridge.interop.pretrained` (orbax, for its checks) is imported where it checks: Grain's worker processes
# import this module to run its sources and `Tokenize`, and start sooner without it.

BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
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
    "use_sft",
    "use_dpo",
    "sft_train_on_completion_only",
    "grain_shuffle_buffer_size",
    # The batches are the same for any worker count, but the saved state holds one entry per worker.
    "grain_worker_count",
)


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

  def map(self, text: str) -> np.ndarray | Damaged:
    if isinstance(text, Damaged):
      return text
    if not self.tokenizer_path:
      return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
      return np.zeros(0, np.int32)  # an empty document stays empty: no lone BOS/EOS row pieces
    return np.asarray([self.bos] * (self.bos is not None) + ids + [self.eos] * (self.eos is not None), np.int32)


class EncodeExamples(grain.transforms.Map):
  """A row (record, where) -> its SFT example or DPO pair, fitted to `length`: a tuple of (tokens, completion mask)
  per side, one for SFT and (chosen, rejected) for DPO, encoded as `data`'s in-memory path encodes them
  (`posttrain.sft`, `posttrain.dpo`: `tokenizer_path`'s tokenizer and chat template, else bytes)."""

  def __init__(self, kind: str, tokenizer_path: str, vocab_size: int, length: int):
    self.kind, self.tokenizer_path, self.vocab_size, self.length = kind, tokenizer_path, vocab_size, length
    self._warned = False

  @functools.cached_property
  def chat(self):
    from maxbridge.training.posttrain import sft  # its tokenizer check imports orbax: not for pre-training's workers

    return sft.HFChat(self.tokenizer_path, self.vocab_size) if self.tokenizer_path else None

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "chat"}  # each worker loads its own

  def map(self, row) -> tuple | Damaged:
    if isinstance(row, Damaged):
      return row
    from maxbridge.training.posttrain import sft

    record, where = row
    if self.kind == "dpo":
      from maxbridge.training.posttrain import dpo

      sides = dpo.fit_pair(
          dpo.record_pair(record, self.chat.encode if self.chat else sft.byte_encode, where), self.length, where
      )
    else:
      sides = (sft.fit(sft.record_example(record, self.chat, where), self.length, where),)
    if not self._warned and any(tokens.size > self.length for tokens, _ in sides):
      # Warned once per process (the in-memory path counts them: a stream cannot, before it ends).
      self._warned = True
      logging.warning(
          "%s: longer than max_target_length=%d tokens and cut to it (the first such %s of this process): "
          "the end of its completion is not trained on",
          where,
          self.length,
          "pair" if self.kind == "dpo" else "example",
      )
    return tuple((tokens[: self.length], completion[: self.length]) for tokens, completion in sides)


# --- packing -------------------------------------------------------------------------


class _Damage:
  """Counts the damaged records an iterator skipped (kept in its state) and stops a stream of nothing else."""

  def __init__(self, limit: int | None):
    self.limit, self.count, self.run = limit, 0, 0

  def skip(self, item) -> bool:
    """True for a `Damaged` (counted, the first one logged); resets the run of them on anything else."""
    if not isinstance(item, Damaged):
      self.run = 0
      return False
    self.count, self.run = self.count + 1, self.run + 1
    if self.count == 1:
      logging.warning("skipping damaged records (grain_skip_damaged_records=true); the first: %s", item.message)
    if self.limit and self.run >= self.limit:
      raise ValueError(
          f"{self.run} records in a row are damaged: every record of this process's share is; "
          f"the last: {item.message}"
      )
    return True


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
    self.damaged = _Damage(empty_limit)
    self._document = np.zeros(0, np.int32)
    self._offset = 0
    self._before = parent.get_state()  # the parent's state before `_document` was read

  def __next__(self) -> dict[str, np.ndarray]:
    pieces, filled = [], 0
    while filled < self.length:
      if self._offset == self._document.size:
        before = self._parent.get_state()
        try:
          item = next(self._parent)
        except StopIteration:
          break
        if self.damaged.skip(item):
          continue
        # A copy: a worker's array lives in shared memory that Grain frees as the iterator moves on.
        document = np.array(item, copy=True)
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
      return {"parent": self._parent.get_state(), "offset": 0, "damaged": self.damaged.count}
    return {"parent": self._before, "offset": self._offset, "damaged": self.damaged.count}

  def set_state(self, state: dict) -> None:
    self.damaged.count = state.get("damaged", 0)
    self._parent.set_state(state["parent"])
    self._before = state["parent"]
    self._document, self._offset = np.zeros(0, np.int32), 0
    if state["offset"]:
      self._document = np.array(next(self._parent), copy=True)
      self._offset = state["offset"]


class PackExamplesIterDataset(grain.IterDataset):
  """SFT examples or DPO pairs (`EncodeExamples`) packed whole into rows of `length` as `sft.pack_examples` and
  `dpo.pack_pairs` pack them, as a stream: the next example goes in the row while every side fits beside the
  examples there, else the row is padded and it starts the next one. DPO's rows are its keys per side, prefixed."""

  def __init__(self, parent: grain.IterDataset, length: int, kind: str, completion_only: bool, limit: int | None = None):
    super().__init__(parent)
    self.length, self.kind, self.completion_only, self.limit = length, kind, completion_only, limit

  def __iter__(self):
    return _PackExamplesIterator(self._parent.__iter__(), self)

  def __str__(self) -> str:
    return f"PackExamplesIterDataset(length={self.length}, {self.kind})"


class _PackExamplesIterator(grain.DatasetIterator):
  """Its state is the parent's before the example the next row starts with (read already when the last row
  was full): small and exact."""

  def __init__(self, parent, spec: PackExamplesIterDataset):
    super().__init__(parent)
    self.spec = spec
    self.damaged = _Damage(spec.limit)
    self._pending = None  # the example that did not fit the last row
    self._before = None  # the parent's state before `_pending` was read

  def _read(self):
    while True:
      before = self._parent.get_state()
      item = next(self._parent)
      if not self.damaged.skip(item):
        # Copies: a worker's arrays live in shared memory that Grain frees as the iterator moves on.
        return before, tuple((np.array(t, copy=True), np.array(c, copy=True)) for t, c in item)

  def __next__(self) -> dict[str, np.ndarray]:
    from maxbridge.training.posttrain import sft

    row, used = [], None
    while True:
      if self._pending is None:
        try:
          self._before, self._pending = self._read()
        except StopIteration:
          break
      sizes = [tokens.size for tokens, _ in self._pending]
      if row and any(u + n > self.spec.length for u, n in zip(used, sizes)):
        break
      row.append(self._pending)
      used = sizes if used is None else [u + n for u, n in zip(used, sizes)]
      self._pending = None
    if not row:
      raise StopIteration
    plan = [list(range(len(row)))]
    if self.spec.kind != "dpo":
      filled = sft.fill_rows(plan, [e[0] for e in row], self.spec.length, self.spec.completion_only)
      return {key: value[0] for key, value in filled.items()}
    out = {}
    for i, side in enumerate(("chosen", "rejected")):  # dpo.SIDES (dpo imports jax: not in this module's workers)
      filled = sft.fill_rows(plan, [e[i] for e in row], self.spec.length, completion_only=True)
      out.update({f"{side}_{key}": value[0] for key, value in filled.items()})
    return out

  def get_state(self) -> dict:
    parent = self._parent.get_state() if self._pending is None else self._before
    return {"parent": parent, "pending": self._pending is not None, "damaged": self.damaged.count}

  def set_state(self, state: dict) -> None:
    self.damaged.count = state.get("damaged", 0)
    self._parent.set_state(state["parent"])
    self._pending = None
    if state["pending"]:
      self._before, self._pending = self._read()


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
    # SFT examples and DPO pairs are read from whole records (their fields), pre-training text from data_columns.
    self.kind = "dpo" if config.use_dpo else "sft" if config.use_sft else "text"
    column = config.data_columns if self.kind == "text" else None
    source = Corpus(resolve_files(files, config.grain_file_type, key), column, config.grain_skip_damaged_records)
    if not config.grain_eval_files:
      source = HeldOut(source, split)
    if len(source) < process_count:
      raise ValueError(
          f"{key}={files!r}: {len(source)} {split} document(s) for {process_count} process(es); "
          "each process needs at least one"
      )
    self.documents = source
    self.name = f"grain {split} ({files})"
    self._iterator = None
    self._next = 0
    self._origin = 0  # the step the data started at (`restart_at`)
    if self.kind != "text":
      from maxbridge.training.posttrain import sft

      if config.tokenizer_path:  # its vocabulary and chat template are checked now, before any worker reads
        sft.HFChat(config.tokenizer_path, config.vocab_size)
      elif config.vocab_size < 256:
        raise ValueError(
            f"dataset_type='grain' with use_{self.kind}=true without tokenizer_path yields byte tokens (0..255) "
            f"but vocab_size={config.vocab_size}; set vocab_size >= 256 or give tokenizer_path"
        )
      self.tokenize = EncodeExamples(self.kind, config.tokenizer_path, config.vocab_size, self.length)
      return
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
    window = self.config.grain_shuffle_buffer_size
    if self.shuffle and not window:
      ds = ds.shuffle(seed=self.config.seed)
    ds = ds.repeat(self.num_epochs)
    if self.shuffle and window:  # after repeat: each window, so each epoch, has its own order
      ds = WindowShuffle(ds, window, self.config.seed)
    ds = ds.map(self.tokenize)
    # A few threads read ahead of the step; the queue bounds memory (documents, not the corpus).
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64))
    # Eval restarts at its step 0 every time: worker processes would start again each time too.
    if self.config.grain_worker_count and self.split == "train":
      if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; a library caller never parsed any
        flags.FLAGS.mark_as_parsed()
      it = it.mp_prefetch(
          grain.MultiprocessingOptions(num_workers=self.config.grain_worker_count), worker_init_fn=_die_with_parent
      )
    # An epoch of empty documents (or damaged records) would never fill a row: an error, not a hang.
    if self.kind == "text":
      rows = PackIterDataset(it, self.length, empty_limit=share)
    else:
      rows = PackExamplesIterDataset(it, self.length, self.kind, self.config.sft_train_on_completion_only, share)
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
    if step < self._origin:
      raise ValueError(f"{self.name}: step must be >= {self._origin} (the step its data started at), got {step}")
    step -= self._origin
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
    state = {"step": self._next, "settings": self.settings, "iterator": self._iterator.get_state()}
    return {**state, "origin": self._origin} if self._origin else state

  def restart_at(self, step: int) -> None:
    """Reads from the data's beginning at `step` (a resume with `restart_data_on_resume`): `batch(step)` is
    the first batch; saved states keep that step."""
    self.close()
    self._origin, self._next = step, 0

  @property
  def damaged(self) -> int:
    """The damaged records skipped by this process (`grain_skip_damaged_records`), counted across resumes."""
    if self._iterator is None:
      return 0
    return self._iterator.get_state()["damaged"]

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
    self._next, self._origin = state["step"], state.get("origin", 0)

  def start_prefetch(self) -> None:
    """Grain's handler calls this after `set_state`; the next `batch` reads ahead by itself."""

  def close(self) -> None:
    """Stops the worker processes, if any."""
    if self._iterator is not None and hasattr(self._iterator, "close"):
      self._iterator.close()
    self._iterator = None

  def __repr__(self) -> str:
    return f"GrainDataset({self.name}, length={self.length}, batch_size={self.batch_size})"


class WindowShuffle(grain.MapDataset):
  """Its parent's records shuffled within consecutive windows of `size` (`grain_shuffle_buffer_size`), each
  window by its own seed: reads stay near one another (a Parquet row group, a file) where a global shuffle
  jumps anywhere. Grain's `WindowShuffleMapDataset` maps the last, partial window's indices past the end; this
  one shuffles it within its own size."""

  def __init__(self, parent: grain.MapDataset, size: int, seed: int):
    super().__init__(parent)
    self.size, self.seed_ = size, seed

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    window, within = divmod(index, self.size)
    start = window * self.size
    last = min(self.size, len(self._parent) - start) - 1
    if last > 0:
      seed = (self.seed_ + window) % 2**32  # index_shuffle takes a uint32 seed
      within = grain.experimental.index_shuffle(within, max_index=last, seed=seed, rounds=4)
    return self._parent[start + within]

  def __str__(self) -> str:
    return f"WindowShuffle(size={self.size})"


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
  prefix = "chosen_" if dataset.kind == "dpo" else ""  # DPO: the chosen side's rows
  segments = np.concatenate([b[f"{prefix}inputs_segmentation"] for b in sample])
  real = int((segments > 0).sum())
  what = {"text": "documents", "sft": "SFT examples", "dpo": "preference pairs"}[dataset.kind]
  lines = [
      f"{dataset.name}: {len(dataset.documents)} training {what}"
      + (f", {len(held)} held out for eval (every {EVAL_EVERY}th)" if held is not None else ""),
      f"tokenizer: {config.tokenizer_path or 'bytes'}; rows of {dataset.length} tokens",
      f"first {batches} batch(es): {segments.shape[0]} rows, {real} tokens, padding {1 - real / segments.size:.2%}",
  ]
  inputs = np.concatenate([b[f"{prefix}inputs"] for b in sample])
  if config.tokenizer_path:
    tokenizer = dataset.tokenize.tokenizer if dataset.kind == "text" else dataset.tokenize.chat.tokenizer
  for r in range(min(rows, inputs.shape[0])):
    pieces = []
    for segment in range(1, int(segments[r].max()) + 1):
      tokens = inputs[r][segments[r] == segment]
      if config.tokenizer_path:
        pieces.append(tokenizer.decode(tokens.tolist(), skip_special_tokens=False))
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
          lines = JsonlSource(path, column="")
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
          records = iter([json.dumps({"text": TextSource([path])[0]}, ensure_ascii=False).encode()])
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


def _json_line(lines: JsonlSource, index: int) -> bytes:
  text, start = lines.line(index)
  try:
    json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{lines.path}: byte offset {start}: not valid JSON ({e.msg})") from e
  return text.strip().encode()
