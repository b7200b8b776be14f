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

Tokenizing is `grain_tokens`'s. Packing (`grain_packing`) is the in-memory path's policy,
done as a stream. Pre-training (`PackIterDataset`, as `data.pack`): documents follow one
another, a document cut at a row's end continues in the next row as a new segment whose
positions restart at 0, and only the last row of a finite stream is padded. Grain's own `ConcatThenSplitIterDataset` differs (a cut document's
positions continue, and full documents may jump ahead of the buffer), so the batches would
not match the in-memory path's; ours is small and keeps them equal. SFT and DPO
(`PackExamplesIterDataset`, as `sft.pack_examples`/`dpo.pack_pairs`): whole examples, a row
padded when the next does not fit. Packing runs after the worker processes, so the batches
are the same for any grain_worker_count.

The iterator's state (a few integers per worker, and the damaged records skipped) is saved
with each checkpoint through Grain's orbax handler (`grain_checkpoint`), so a resumed run
reads exactly the batches an uninterrupted one would have; a resume whose data settings
differ is refused, naming the key, unless `restart_data_on_resume` starts the new data
from its beginning. Path keys are compared by what they name (`data.same_setting`), and
the state records each file read with its fingerprint (`data_paths.fingerprint`): a
file replaced, edited, added or removed since is refused likewise, naming it (a state
saved before states held fingerprints resumes unchecked).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import grain
import numpy as np
from absl import flags

from maxbridge.core.checkpointing import CheckpointError
from maxbridge.core.config import Config
from maxbridge.training import grain_checkpoint, grain_sources
from maxbridge.training.data_paths import fingerprint, same_setting
from maxbridge.training.grain_packing import PackExamplesIterDataset, PackIterDataset
from maxbridge.training.grain_sources import (
    EVAL_EVERY,
    Corpus,
    HeldOut,
    JsonlSource,
    TextSource,
    resolve_files,
)
from maxbridge.training.grain_tokens import EncodeExamples, Tokenize, special_token

# `maxbridge.interop.pretrained` (orbax, for its checks) is imported where it checks: Grain's worker processes
# import this module (`_die_with_parent`), and start sooner without it.

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
    "use_orpo",
    "use_simpo",
    "use_kto",
    "sft_train_on_completion_only",
    "grain_shuffle_buffer_size",
    # The batches are the same for any worker count, but the saved state holds one entry per worker.
    "grain_worker_count",
)


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
    self.kind = "kto" if config.use_kto else "dpo" if config.preference_loss else "sft" if config.use_sft else "text"
    column = config.data_columns if self.kind == "text" else None
    found = resolve_files(files, config.grain_file_type, key)
    # As the files are as the pipeline opens them: what a saved state's position is into.
    self.fingerprints = [[os.path.realpath(path), fingerprint(path)] for path, _ in found]
    source = Corpus(found, column, config.grain_skip_damaged_records)
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
            f"dataset_type='grain' with {config.preference_loss or 'use_sft'}=true without tokenizer_path yields byte tokens (0..255) "
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
    state = {
        "step": self._next,
        "settings": self.settings,
        "files": self.fingerprints,
        "iterator": self._iterator.get_state(),
    }
    return {**state, "origin": self._origin} if self._origin else state

  def _changed_files(self, saved: list[list[str]]) -> list[str]:
    """What differs between the files a state was saved with and ours, each naming the file."""
    ours, theirs = dict(map(tuple, self.fingerprints)), dict(map(tuple, saved))
    changed = [f"{path}: new since the checkpoint" for path in ours if path not in theirs]
    changed += [f"{path}: gone since the checkpoint" for path in theirs if path not in ours]
    for path in ours.keys() & theirs.keys():
      if ours[path] != theirs[path]:
        (was_size, _), (size, _) = theirs[path].split(":"), ours[path].split(":")
        how = "other contents, same size" if was_size == size else f"{was_size} -> {size} bytes"
        changed.append(f"{path}: changed since the checkpoint ({how}; fingerprint {theirs[path]} -> {ours[path]})")
    return sorted(changed)

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

  def snapshot(self) -> grain.checkpoint.CheckpointSave:
    """The state now, frozen, as the checkpoint item a save writes (`grain_checkpoint`)."""
    return grain_checkpoint.save_item(self.get_state())

  def restore_item(self) -> grain.checkpoint.CheckpointRestore:
    """The checkpoint item that sets this dataset to the state saved with a step (`grain_checkpoint`)."""
    return grain_checkpoint.restore_item(self)

  def set_state(self, state: dict | bytes) -> None:
    """Goes on from a saved state (or its JSON bytes, as Grain's checkpoint handler gives it); refuses one saved
    with other data settings, naming the key."""
    if isinstance(state, bytes):
      state = json.loads(state)
    changed = [
        f"{key}: {state['settings'].get(key)!r} -> {value!r}"
        for key, value in self.settings.items()
        if not same_setting(key, state["settings"].get(key), value)
    ]
    if changed:
      raise CheckpointError(
          f"{self.name}: the checkpoint's data iterator was saved with other data settings ({'; '.join(changed)}); "
          "resume with the values it was saved with, or start a new run_name"
      )
    # A state saved before states recorded their files holds none: such a run resumes as it always did.
    changed = self._changed_files(state["files"]) if "files" in state else []
    if changed:
      raise CheckpointError(
          f"{self.name}: the checkpoint's data iterator was saved reading other files ({'; '.join(changed)}); the "
          "saved position would read other records. Restore the files it was saved with, or set "
          "restart_data_on_resume=true to start the new data from its beginning, or start a new run_name"
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
  prefix = {"dpo": "chosen_", "kto": "completion_"}.get(dataset.kind, "")  # the first side's rows
  segments = np.concatenate([b[f"{prefix}inputs_segmentation"] for b in sample])
  real = int((segments > 0).sum())
  what = {"text": "documents", "sft": "SFT examples", "dpo": "preference pairs", "kto": "KTO examples"}[dataset.kind]
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
          try:
            table = pq.ParquetFile(path)
          except grain_sources.read_errors() as e:
            raise grain_sources.damaged_file(path, kind, "its footer", e) from e
          total = table.metadata.num_rows
          records = _read_parquet(table, path)
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


def _read_parquet(table, path: str):
  """The rows of a Parquet file as JSON bytes; one that cannot be decoded is a `DamagedFile` naming it."""
  try:
    for batch in table.iter_batches():
      for row in batch.to_pylist():
        yield json.dumps(row, ensure_ascii=False, default=str).encode()
  except (*grain_sources.read_errors(), UnicodeDecodeError) as e:
    raise grain_sources.damaged_file(path, "parquet", "its row groups", e) from e


def _json_line(lines: JsonlSource, index: int) -> bytes:
  text, start = lines.line(index)
  try:
    json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{lines.path}: byte offset {start}: not valid JSON ({e.msg})") from e
  return text.strip().encode()
