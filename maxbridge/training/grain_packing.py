"""Grain's packing step (`grain_data`): token arrays, or whole SFT examples and DPO pairs, into rows, as a stream.

Pre-training (`PackIterDataset`, as `data.pack`): documents follow one another, a document cut at a row's end
continues in the next row as a new segment whose positions restart at 0, and only the last row of a finite
stream is padded. SFT and DPO (`PackExamplesIterDataset`, as `sft.pack_examples`/`dpo.pack_pairs`): whole
examples, a row padded when the next does not fit. Each iterator's state (`get_state`) is saved with a checkpoint.
"""

from __future__ import annotations

import grain
import numpy as np
from absl import logging

from maxbridge.training.grain_sources import Damaged


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
  examples there, else the row is padded and it starts the next one. DPO's rows are its keys per side, prefixed.
  KTO's (`kto.pack`'s keys): each example beside its mismatched pair, its prompt with the previous example's
  completion in the stream; the stream's first example has none (its prompt alone, left out of KTO's z_ref)."""

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
    self._previous = None  # KTO: the completion of the last example read, for the next one's mismatched pair
    self._previous_before = None  # ... as it was before `_pending` was read

  def _read(self):
    while True:
      before = self._parent.get_state()
      item = next(self._parent)
      if not self.damaged.skip(item):
        # Copies: a worker's arrays live in shared memory that Grain frees as the iterator moves on.
        item = tuple((np.array(t, copy=True), np.array(c, copy=True)) for t, c in item)
        self._previous_before = self._previous
        return before, self._mismatched(item) if self.spec.kind == "kto" else item

  def _mismatched(self, item):
    """KTO's (example, its prompt with the previous example's completion, label): `kto.examples` as a stream."""
    from maxbridge.training.posttrain import sft

    (tokens, completion), label = item
    prompt = tokens[: int(np.argmax(completion))]
    if self._previous is None:  # its prompt alone, no completion token: a segment KTO's z_ref leaves out
      kl = (prompt if prompt.size else tokens[:1], np.zeros(max(prompt.size, 1), bool))
    else:
      kl = sft.fit(sft.example(list(prompt), list(self._previous)), self.spec.length, "a KTO mismatched pair")
      kl = (kl[0][: self.spec.length], kl[1][: self.spec.length])
    self._previous = tokens[completion]
    return (tokens, completion), kl, label

  def __next__(self) -> dict[str, np.ndarray]:
    from maxbridge.training.posttrain import sft

    row, used = [], None
    while True:
      if self._pending is None:
        try:
          self._before, self._pending = self._read()
        except StopIteration:
          break
      sizes = [tokens.size for tokens, _ in self._pending[:2]]  # KTO's third is its label
      if row and any(u + n > self.spec.length for u, n in zip(used, sizes)):
        break
      row.append(self._pending)
      used = sizes if used is None else [u + n for u, n in zip(used, sizes)]
      self._pending = None
    if not row:
      raise StopIteration
    plan = [list(range(len(row)))]
    if self.spec.kind not in ("dpo", "kto"):
      filled = sft.fill_rows(plan, [e[0] for e in row], self.spec.length, self.spec.completion_only)
      return {key: value[0] for key, value in filled.items()}
    out = {}
    # dpo.SIDES and kto.SIDES (they import jax: not in this module's workers)
    for i, side in enumerate(("chosen", "rejected") if self.spec.kind == "dpo" else ("completion", "kl")):
      filled = sft.fill_rows(plan, [e[i] for e in row], self.spec.length, completion_only=True)
      out.update({f"{side}_{key}": value[0] for key, value in filled.items()})
    if self.spec.kind == "kto":
      segments = out["completion_targets_segmentation"]
      desirable = [segment for segment, e in enumerate(row, start=1) if e[2][0][0]]
      out["desirable_segmentation"] = np.where(np.isin(segments, desirable), segments, 0).astype(np.int32)
    return out

  def get_state(self) -> dict:
    parent = self._parent.get_state() if self._pending is None else self._before
    previous = self._previous if self._pending is None else self._previous_before
    state = {"parent": parent, "pending": self._pending is not None, "damaged": self.damaged.count}
    return state if previous is None else {**state, "previous": previous.tolist()}

  def set_state(self, state: dict) -> None:
    self.damaged.count = state.get("damaged", 0)
    self._parent.set_state(state["parent"])
    self._pending = None
    self._previous = None if state.get("previous") is None else np.asarray(state["previous"], np.int32)
    if state["pending"]:
      self._before, self._pending = self._read()
