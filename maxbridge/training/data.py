"""Training data: documents packed into fixed-length rows, read in a seeded order.

numpy only (no jax or tf), so loading data never starts an accelerator. Corpora
larger than memory go through Grain (`dataset_type: grain`, `grain_data`), imported
only by the runs that read one.
Batches use MaxText's names, each an int32 array [batch, max_target_length]:

    inputs                tokens
    targets               the next token within the same document (0 where none)
    inputs_position       position within the document piece, from 0
    inputs_segmentation   document piece id within the row, from 1; 0 = padding
    targets_segmentation  as inputs_segmentation, but 0 where there is no target
                          (the last token of each piece), so the loss masks it

`Dataset.batch(step)` is a pure function of (seed, step): a run resumed at
step k reads exactly the batches an uninterrupted run would have read.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from maxbridge.core.config import Config
from maxbridge.training.data_paths import same_setting  # noqa: F401  (callers' name for it: data.same_setting)
from maxbridge.training.posttrain import dpo, kto, sft

# What `pack` makes. A loss declares the keys it reads (`maxbridge.loss`); a
# Dataset carries whatever keys its rows have.
BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
SPLITS = ("train", "eval")
# The config keys that say which rows a run reads, besides its seed and the batches' shape: one list, which a resume
# may not change (`hooks.Data.fixed_keys`) and offline distillation logits record (`distill.write_logits`).
DATA_KEYS = (
    "dataset_type",
    "dataset_path",
    "tokenizer_path",
    "grain_train_files",
    "grain_eval_files",
    "grain_file_type",
    "data_columns",
    "add_bos",
    "add_eos",
    "use_sft",
    "grain_shuffle_buffer_size",
)
DATASET_TYPES = ("embedded", "synthetic", "text", "sft", "grain")


# Every EVAL_EVERY-th document (index % EVAL_EVERY == 0) is held out for eval.
EVAL_EVERY = 20
# The embedded corpus stops after about this many bytes of source, so that
# reading and packing it stays well under two seconds.
EMBEDDED_BYTE_BUDGET = 8_000_000
# Directories of the standard library left out of the embedded corpus:
# third-party code, the test suite and IDLE are not what we want to model.
EMBEDDED_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "__pycache__"})
SYNTHETIC_ROWS = 4096
BYTE_VOCAB = 256


def pack(documents: Iterable[np.ndarray], length: int) -> dict[str, np.ndarray]:
  """Concatenate 1-D token arrays into rows of `length`; one int32 [rows, length] array per key.

  Documents follow one another with no gap. Where a row ends mid-document,
  the rest of the document continues in the next row as a new segment whose
  positions restart at 0. That loses the context before the cut, but keeps
  every row self-contained and wastes no tokens; only the last row is padded.
  Empty documents are dropped.
  """
  if length < 1:
    raise ValueError(f"pack() length must be a positive integer, got {length}")
  pieces = []
  for i, doc in enumerate(documents):
    doc = np.asarray(doc)
    if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
      raise ValueError(f"document {i} must be a 1-D integer token array, got shape {doc.shape} dtype {doc.dtype}")
    if doc.size:
      pieces.append(doc)
  if not pieces:
    return {key: np.zeros((0, length), np.int32) for key in BATCH_KEYS}

  stream = np.concatenate(pieces).astype(np.int32)
  num_tokens = stream.size
  num_rows = -(-num_tokens // length)
  # int32 throughout: half the memory traffic of numpy's default int64.
  index = np.arange(num_rows * length, dtype=np.int32)
  real = index < num_tokens

  # A segment starts at every document start and at every row start.
  starts = np.zeros(index.size, bool)
  starts[np.cumsum([doc.size for doc in pieces])[:-1]] = True
  starts[::length] = True
  starts &= real

  inputs = np.zeros(index.size, np.int32)
  inputs[:num_tokens] = stream
  # Running count of starts, made relative to each row's first segment (a
  # row always begins with a real token, so that count is its segment 1).
  segment = np.cumsum(starts, dtype=np.int32).reshape(num_rows, length)
  segment = (segment - segment[:, :1] + 1).reshape(-1) * real
  position = (index - np.maximum.accumulate(index * starts)) * real
  # A token has a target when the next token is real and not a new segment;
  # this is what keeps targets from crossing a document or row boundary.
  has_target = np.zeros(index.size, bool)
  has_target[:-1] = real[1:] & ~starts[1:]
  targets = np.zeros(index.size, np.int32)
  targets[:-1] = inputs[1:]
  targets *= has_target

  rows = {
      "inputs": inputs,
      "targets": targets,
      "inputs_position": position,
      "inputs_segmentation": segment,
      "targets_segmentation": segment * has_target,
  }
  return {key: value.astype(np.int32, copy=False).reshape(num_rows, length) for key, value in rows.items()}


class Dataset:
  """Packed rows and the seeded order they are read in.

  Row order: the global row counter k = step * batch_size + j reads row
  permutation(seed, epoch)[k % num_rows] with epoch = k // num_rows, so each
  epoch visits every row once, in a fresh order, and any step can be
  computed without replaying the steps before it.
  """

  def __init__(self, rows: dict[str, np.ndarray], batch_size: int, seed: int, name: str = "dataset"):
    if not any(key.endswith("inputs") for key in rows):
      raise ValueError(
          f"{name}: rows must include 'inputs' (and what the loss reads, e.g. {BATCH_KEYS}), got {sorted(rows)}"
      )
    shapes = {key: value.shape for key, value in rows.items()}
    self._shape = next(iter(shapes.values()))
    if len(set(shapes.values())) != 1 or len(self._shape) != 2:
      raise ValueError(f"{name}: rows must all be [num_rows, length] with one shape, got {shapes}")
    if self._shape[0] == 0:
      raise ValueError(f"{name}: has no rows (no non-empty documents)")
    # Preference rows have one targets_segmentation per side (chosen_..., rejected_...).
    if not all(value.any() for key, value in rows.items() if key.endswith("targets_segmentation")):
      # Every loss would be over zero targets: 0.0, reported as if the model were perfect.
      raise ValueError(
          f"{name}: no token has a next token to predict (every document is one token long); "
          "give documents of at least 2 tokens"
      )
    if batch_size < 1:
      raise ValueError(f"{name}: batch size must be a positive integer, got {batch_size}")
    self.rows = rows
    self.batch_size = batch_size
    self.seed = seed
    self.name = name

  @property
  def num_rows(self) -> int:
    return self._shape[0]

  @property
  def length(self) -> int:
    return self._shape[1]

  @property
  def tokens_per_batch(self) -> int:
    """Token slots in one global batch, padding included."""
    return self.batch_size * self.length

  def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
    """The global batch for `step`, or this process's contiguous slice of it.

    With `process_count` P, process i gets rows [i*B/P, (i+1)*B/P) of the
    global batch of B rows, so the slices of all processes concatenate
    back to the global batch.
    """
    if step < 0:
      raise ValueError(f"{self.name}: step must be >= 0, got {step}")
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ValueError(
          f"{self.name}: process_index must be in [0, process_count), "
          f"got process_index={process_index}, process_count={process_count}"
      )
    if self.batch_size % process_count:
      raise ValueError(
          f"{self.name}: global batch size {self.batch_size} is not divisible by "
          f"process_count={process_count}; use a batch size that is a multiple of it"
      )
    per_process = self.batch_size // process_count
    first = step * self.batch_size + process_index * per_process
    counters = np.arange(first, first + per_process)
    epochs, offsets = np.divmod(counters, self.num_rows)
    row_ids = np.empty(per_process, np.int64)
    # A batch may straddle an epoch boundary (or span several epochs when
    # the batch is bigger than the dataset); each counter uses its own epoch.
    for epoch in np.unique(epochs):
      here = epochs == epoch
      row_ids[here] = _permutation(self.seed, int(epoch), self.num_rows)[offsets[here]]
    # Fancy indexing copies, so the caller may modify the batch freely.
    return {key: value[row_ids] for key, value in self.rows.items()}

  # Its batches are a pure function of the step: a checkpoint saves nothing of it (`grain_data.GrainDataset`
  # is stateful: its iterator's state is saved).
  stateful = False

  def __repr__(self) -> str:
    return (
        f"Dataset({self.name}, num_rows={self.num_rows}, length={self.length}, "
        f"batch_size={self.batch_size}, seed={self.seed})"
    )


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, num_rows: int) -> np.ndarray:
  # Cached because consecutive steps almost always share an epoch.
  return np.random.default_rng([seed, epoch]).permutation(num_rows)


def make_dataset(
    config: Config,
    split: str = "train",
    global_batch_size: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
):
  """The `split` ("train" or "eval") of `config.dataset_type`, packed to max_target_length.

  `global_batch_size` defaults to `config.per_device_batch_size`; a caller
  on several devices passes per_device_batch_size * device count. A Grain
  dataset (`grain_data.GrainDataset`, the same `batch`) reads only the share
  of process `process_index` of `process_count`; the others read everything
  and `batch` slices it.
  """
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(map(repr, SPLITS))}")
  length = config.max_target_length
  batch_size = config.per_device_batch_size if global_batch_size is None else global_batch_size
  if config.dataset_type == "grain":
    from maxbridge.training import grain_data  # grain and its threads only for the runs that read through it

    return grain_data.GrainDataset(config, split, batch_size, process_index, process_count)
  if config.use_kto:
    rows = _kto_rows(config, split, length)
    name = f"KTO rows {split} ({config.dataset_path or 'built-in arithmetic'})"
  elif config.preference_loss:
    rows = _preference_rows(config, split, length)
    name = f"preferences {split} ({config.dataset_path or 'built-in arithmetic'})"
  elif config.dataset_type == "embedded":
    _check_byte_vocab(config)
    rows = _embedded_rows(split, length)
    name = f"embedded {split}"
  elif config.dataset_type == "synthetic":
    rows = _synthetic_rows(split, length, config.vocab_size, config.seed)
    name = f"synthetic {split}"
  elif config.dataset_type == "text":
    _check_byte_vocab(config)
    rows = _text_rows(config.dataset_path, split, length)
    name = f"text {split} ({config.dataset_path})"
  elif config.dataset_type == "sft":
    rows = _sft_rows(config, split, length)
    name = f"sft {split} ({config.dataset_path or 'built-in arithmetic'})"
  else:
    raise ValueError(f"unknown dataset_type {config.dataset_type!r}; valid values: {', '.join(map(repr, DATASET_TYPES))}")
  return Dataset(rows, batch_size, config.seed, name)


def _preference_encode(config: Config) -> sft.Encode:
  if config.tokenizer_path:
    return sft.HFChat(config.tokenizer_path, config.vocab_size).encode
  _check_byte_vocab(config)
  return sft.byte_encode


def _preference_rows(config: Config, split: str, length: int) -> dict[str, np.ndarray]:
  encode = _preference_encode(config)
  if not config.dataset_path:
    if config.tokenizer_path:
      raise ValueError(
          f"{config.preference_loss} with tokenizer_path needs dataset_path: the built-in set is byte tokens"
      )
    return _builtin_preference_rows(split, length)
  pairs = []
  for path in text_files(config.dataset_path):
    if path.suffix != ".jsonl":
      raise ValueError(f"{config.preference_loss}=true reads .jsonl files (prompt/chosen/rejected rows), got {path}")
    pairs += dpo.jsonl_pairs(path, encode, length)
  return dpo.pack_pairs(_split_examples(pairs, split, f"dataset_path {config.dataset_path!r}"), length)


@functools.lru_cache(maxsize=8)
def _builtin_preference_rows(split: str, length: int) -> dict[str, np.ndarray]:
  pairs = dpo.fit_pairs(list(dpo.builtin_pairs()), length, "the built-in preference set")
  return _freeze(dpo.pack_pairs(_split_examples(pairs, split, "the built-in preference set"), length))


def _kto_rows(config: Config, split: str, length: int) -> dict[str, np.ndarray]:
  """KTO's examples: each row with its mismatched pair formed over the whole file order (`kto.examples`), then
  split and packed."""
  encode = _preference_encode(config)
  if not config.dataset_path:
    if config.tokenizer_path:
      raise ValueError("use_kto with tokenizer_path needs dataset_path: the built-in set is byte tokens")
    return _builtin_kto_rows(split, length)
  rows = []
  for path in text_files(config.dataset_path):
    if path.suffix != ".jsonl":
      raise ValueError(f"use_kto=true reads .jsonl files (prompt/completion/label rows), got {path}")
    rows += kto.jsonl_rows(path, encode)
  source = f"dataset_path {config.dataset_path!r}"
  return kto.pack(_split_examples(kto.fit_examples(kto.examples(rows), length, source), split, source), length)


@functools.lru_cache(maxsize=8)
def _builtin_kto_rows(split: str, length: int) -> dict[str, np.ndarray]:
  source = "the built-in KTO set"
  items = kto.fit_examples(kto.examples(list(kto.builtin_rows())), length, source)
  return _freeze(kto.pack(_split_examples(items, split, source), length))


def _sft_rows(config: Config, split: str, length: int) -> dict[str, np.ndarray]:
  completion_only = config.sft_train_on_completion_only
  if not config.tokenizer_path:
    _check_byte_vocab(config)
  if not config.dataset_path:
    if config.tokenizer_path:
      raise ValueError("dataset_type='sft' with tokenizer_path needs dataset_path: the built-in set is byte tokens")
    return _builtin_sft_rows(split, length, completion_only)
  chat = sft.HFChat(config.tokenizer_path, config.vocab_size) if config.tokenizer_path else None
  examples = []
  for path in text_files(config.dataset_path):
    if path.suffix != ".jsonl":
      raise ValueError(f"dataset_type='sft' reads .jsonl files (prompt/completion or messages rows), got {path}")
    examples += sft.jsonl_examples(path, chat, length)
  return sft.pack_examples(
      _split_examples(examples, split, f"dataset_path {config.dataset_path!r}"), length, completion_only
  )


@functools.lru_cache(maxsize=8)
def _builtin_sft_rows(split: str, length: int, completion_only: bool) -> dict[str, np.ndarray]:
  examples = sft.fit_examples(list(sft.builtin_examples()), length, "the built-in SFT set")
  examples = _split_examples(examples, split, "the built-in SFT set")
  return _freeze(sft.pack_examples(examples, length, completion_only))


def _split_examples(examples: list, split: str, source: str) -> list:
  """The same held-out rule as documents: every EVAL_EVERY-th example is eval."""
  held_out = split == "eval"
  chosen = [e for i, e in enumerate(examples) if (i % EVAL_EVERY == 0) == held_out]
  if not chosen:
    raise ValueError(
        f"{source} has {len(examples)} example(s) and none left for the {split!r} split "
        f"(eval holds every example whose index % {EVAL_EVERY} == 0, train the rest); give at least 2"
    )
  return chosen


def _check_byte_vocab(config: Config) -> None:
  if config.vocab_size < BYTE_VOCAB:
    raise ValueError(
        f"dataset_type={config.dataset_type!r} yields byte tokens (0..255) but vocab_size="
        f"{config.vocab_size}; set vocab_size >= {BYTE_VOCAB} or use dataset_type='synthetic'"
    )


def _bytes_to_tokens(data: bytes) -> np.ndarray:
  return np.frombuffer(data, dtype=np.uint8)


def _split_documents(documents: list[np.ndarray], split: str, source: str) -> list[np.ndarray]:
  held_out = split == "eval"
  chosen = [doc for i, doc in enumerate(documents) if (i % EVAL_EVERY == 0) == held_out]
  if not any(doc.size for doc in chosen):
    raise ValueError(
        f"{source} has {len(documents)} document(s) and none left for the {split!r} split "
        f"(eval holds every document whose index % {EVAL_EVERY} == 0, train the rest); "
        f"give it at least 2 non-empty documents, e.g. several .txt files or a .jsonl with one per line"
    )
  return chosen


def _freeze(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  # Cached rows are shared by every Dataset in the process; read-only
  # arrays make an accidental in-place edit fail instead of corrupting them.
  for value in rows.values():
    value.flags.writeable = False
  return rows


@functools.lru_cache(maxsize=1)
def _stdlib_documents() -> tuple[np.ndarray, ...]:
  root = Path(sysconfig.get_paths()["stdlib"])
  paths = []
  for folder, subfolders, files in os.walk(root):
    subfolders[:] = [d for d in subfolders if d not in EMBEDDED_SKIP_DIRS]
    paths += [Path(folder, f).relative_to(root) for f in files if f.endswith(".py")]
  documents, total = [], 0
  # Sorted relative paths make the corpus (and so the eval split) the same
  # on every run of the same Python version.
  for path in sorted(paths, key=str):
    if total >= EMBEDDED_BYTE_BUDGET:
      break
    documents.append(_bytes_to_tokens((root / path).read_bytes()))
    total += documents[-1].size
  if not documents:
    raise ValueError(f"no .py files found under the standard library at {root}")
  return tuple(documents)


@functools.lru_cache(maxsize=8)
def _embedded_rows(split: str, length: int) -> dict[str, np.ndarray]:
  documents = _split_documents(list(_stdlib_documents()), split, "the embedded stdlib corpus")
  return _freeze(pack(documents, length))


@functools.lru_cache(maxsize=8)
def _synthetic_rows(split: str, length: int, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
  # Each split draws its own stream, so eval never repeats train.
  rng = np.random.default_rng([seed, SPLITS.index(split)])
  tokens = rng.integers(0, vocab_size, size=SYNTHETIC_ROWS * length, dtype=np.int32)
  # Each token starts a new document with probability 1/length: document
  # lengths vary (geometric, mean `length`), some share a row, some span
  # rows, and the total is exactly SYNTHETIC_ROWS full rows.
  cuts = np.flatnonzero(rng.random(tokens.size) < 1 / length)
  return _freeze(pack(np.split(tokens, cuts), length))


def text_files(dataset_path: str) -> list[Path]:
  """The files `dataset_path` (a folder, file or glob) names, sorted; an error if none."""
  if os.path.isdir(dataset_path):
    files = [p for p in Path(dataset_path).rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file()]
    wanted = f"no .txt or .jsonl files under folder {dataset_path!r}"
  else:
    files = [Path(p) for p in glob.glob(dataset_path, recursive=True) if os.path.isfile(p)]
    wanted = f"no files match dataset_path {dataset_path!r} (a folder, file or glob)"
  if not files:
    raise ValueError(wanted)
  return sorted(files)


def _jsonl_documents(path: Path) -> list[np.ndarray]:
  documents = []
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); .jsonl files must be UTF-8") from e
  # Lines end at "\n" only: a JSON string may hold U+2028, which splitlines() would cut at.
  for line_number, line in enumerate(text.split("\n"), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{line_number}: not valid JSON ({e.msg})") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
      raise ValueError(f'{path}:{line_number}: expected a JSON object with a string "text" field')
    documents.append(_bytes_to_tokens(record["text"].encode("utf-8")))
  return documents


def _text_rows(dataset_path: str, split: str, length: int) -> dict[str, np.ndarray]:
  # Not cached: the files are the user's and may change between calls.
  documents = []
  for path in text_files(dataset_path):
    if path.suffix == ".jsonl":
      documents += _jsonl_documents(path)
    else:
      # Any other file (.txt, or whatever a glob matched) is one document.
      documents.append(_bytes_to_tokens(path.read_bytes()))
  return pack(_split_documents(documents, split, f"dataset_path {dataset_path!r}"), length)
