"""Grain's tokenizing step (`grain_data`): text to token ids, and SFT examples or DPO pairs to their encoded sides.

Grain's worker processes import this module to run `Tokenize` and `EncodeExamples`: what they need beyond it
(`maxbridge.interop.pretrained`, which imports orbax for its checks; `posttrain`) is imported where it is used,
so that they start sooner.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import grain
import numpy as np
from absl import logging

from maxbridge.training.grain_sources import Damaged


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
    if self.kind == "kto":  # the example and its label; the packer pairs it with the previous one's completion
      from maxbridge.training.posttrain import kto

      prompt, completion, desirable = kto.record_row(record, self.chat.encode if self.chat else sft.byte_encode, where)
      label = (np.array([int(desirable)], np.int32), np.zeros(1, bool))
      sides = (sft.fit(sft.example(prompt, completion), self.length, where), label)
    elif self.kind == "dpo":
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
