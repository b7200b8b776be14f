"""Supervised fine-tuning data: prompt -> completion examples, packed whole into rows.

An example is a prompt and a completion (or a chat of `messages`, rendered by
a template into the same two kinds of span). Examples are packed whole, one
segment each, so attention never crosses examples (the segment ids) and no
example is cut from its prompt; a row that cannot fit the next example is
padded. With `sft_train_on_completion_only`, `targets_segmentation` is 0 on
every target that is a prompt token, so the loss (plain cross-entropy, which
masks on it) counts completion tokens only.

Without a dataset_path the rows come from a built-in set generated
deterministically: `a+b=` -> `<sum>\n` for a, b in [0, ARITHMETIC_MAX].

Chat template (byte tokens, no tokenizer_path): each message is rendered as

    <|role|>\n{content}<|end|>\n

with role "system", "user" or "assistant"; the assistant's `{content}<|end|>`
is its completion, the rest is prompt. With a Hugging Face tokenizer folder
(`tokenizer_path`) whose tokenizer_config.json has a `chat_template`, that
template renders the chat instead, and each assistant turn is the text the
template adds after the generation prompt.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import numpy as np

ARITHMETIC_MAX = 19
CHAT_ROLES = ("system", "user", "assistant")
END_OF_TURN = "<|end|>"

# (tokens, completion) per example: int32 tokens and a bool mask, True on completion tokens.
Example = tuple[np.ndarray, np.ndarray]
Encode = Callable[[str], list[int]]


def byte_encode(text: str) -> list[int]:
  return list(text.encode("utf-8"))


def arithmetic_pairs(max_operand: int = ARITHMETIC_MAX) -> list[tuple[str, str]]:
  """The built-in SFT set: every `a+b=` with its answer, in a fixed shuffled order.

  Shuffled so that the held-out examples (every 20th) are a spread of sums,
  not one family such as every `a+0`.
  """
  pairs = [(f"{a}+{b}=", f"{a + b}\n") for a in range(max_operand + 1) for b in range(max_operand + 1)]
  return [pairs[i] for i in np.random.default_rng(0).permutation(len(pairs))]


def example(prompt: list[int], completion: list[int]) -> Example:
  tokens = np.asarray(prompt + completion, np.int32)
  return tokens, np.arange(tokens.size) >= len(prompt)


def render_chat(messages: list, encode: Encode = byte_encode, where: str = "messages") -> Example:
  """A chat in the built-in template (see the module docstring): assistant turns are the completion."""
  tokens, mask = [], []
  for message in _check_messages(messages, where):
    head, body, tail = encode(f"<|{message['role']}|>\n"), encode(message["content"] + END_OF_TURN), encode("\n")
    tokens += head + body + tail
    mask += [False] * len(head) + [message["role"] == "assistant"] * len(body) + [False] * len(tail)
  return np.asarray(tokens, np.int32), np.asarray(mask, bool)


def _check_messages(messages, where: str) -> list[dict]:
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
  for i, message in enumerate(messages):
    if (
        not isinstance(message, dict)
        or message.get("role") not in CHAT_ROLES
        or not isinstance(message.get("content"), str)
    ):
      raise ValueError(
          f"{where}: messages[{i}] must be an object with 'role' in {list(CHAT_ROLES)} and a string 'content', "
          f"got {message!r}"
      )
  if not any(m["role"] == "assistant" for m in messages):
    raise ValueError(f"{where}: no 'assistant' message, so nothing to train on")
  return messages


class HFChat:
  """A Hugging Face tokenizer folder: tokenizer.json encodes, tokenizer_config.json's chat_template renders."""

  def __init__(self, folder: str):
    from tokenizers import Tokenizer

    path = Path(folder)
    if not (path / "tokenizer.json").is_file():
      raise ValueError(f"tokenizer_path={folder!r} has no tokenizer.json")
    self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    settings = path / "tokenizer_config.json"
    self.settings = json.loads(settings.read_text(encoding="utf-8")) if settings.is_file() else {}
    self.template = self.settings.get("chat_template")

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
    import jinja2

    special = {k: v for k, v in self.settings.items() if k.endswith("_token") and isinstance(v, str)}
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(self.template)
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)

  def render_chat(self, messages: list, where: str = "messages") -> Example:
    if not self.template:
      return render_chat(messages, self.encode, where)
    messages = _check_messages(messages, where)
    # Each assistant turn is what the template adds to the conversation
    # before it beyond the generation prompt: the tokens a model must produce.
    tokens, mask, done = [], [], ""
    for i, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      before = self._render(messages[:i], add_generation_prompt=True)
      after = self._render(messages[: i + 1], add_generation_prompt=False)
      if not (before.startswith(done) and after.startswith(before)):
        raise ValueError(f"{where}: the tokenizer's chat_template does not render turns as prefixes of each other")
      prompt, answer = self.encode(before[len(done) :]), self.encode(after[len(before) :])
      tokens += prompt + answer
      mask += [False] * len(prompt) + [True] * len(answer)
      done = after
    return np.asarray(tokens, np.int32), np.asarray(mask, bool)


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
  """(line number, object) for each non-empty line of a UTF-8 .jsonl file."""
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); .jsonl files must be UTF-8") from e
  records = []
  for number, line in enumerate(text.split("\n"), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from e
    if not isinstance(record, dict):
      raise ValueError(f"{path}:{number}: expected a JSON object")
    records.append((number, record))
  return records


def jsonl_examples(path: Path, chat=None) -> list[Example]:
  """Examples from rows with string `prompt` and `completion`, or a chat `messages` list."""
  encode = chat.encode if chat else byte_encode
  examples = []
  for number, record in read_jsonl(path):
    where = f"{path}:{number}"
    if "messages" in record:
      examples.append(
          chat.render_chat(record["messages"], where) if chat else render_chat(record["messages"], encode, where)
      )
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
      examples.append(example(encode(record["prompt"]), encode(record["completion"])))
    else:
      raise ValueError(
          f'{where}: an SFT row needs string "prompt" and "completion" fields, or a "messages" list; '
          f"it has {sorted(record)}"
      )
  return examples


def pack_examples(examples: list[Example], length: int, completion_only: bool) -> dict[str, np.ndarray]:
  """Whole examples into rows of `length`, one segment each; MaxText's batch keys, int32 [rows, length].

  An example longer than a row is cut to `length` tokens. The target of a
  token counts (nonzero `targets_segmentation`) when the next token is in the
  same example and, with `completion_only`, is a completion token.
  """
  examples = [(tokens[:length], completion[:length]) for tokens, completion in examples if tokens.size]
  return fill_rows(plan_rows([[e[0].size] for e in examples], length), examples, length, completion_only)


def plan_rows(sizes: list[list[int]], length: int) -> list[list[int]]:
  """Example indices per row, in order; each example's `sizes` (one per side: DPO packs chosen and
  rejected rows in step) must all fit beside the examples already in the row."""
  rows: list[list[int]] = [[]]
  used = [0] * (len(sizes[0]) if sizes else 0)
  for i, sides in enumerate(sizes):
    if any(u + n > length for u, n in zip(used, sides)):
      rows.append([])
      used = [0] * len(sides)
    rows[-1].append(i)
    used = [u + n for u, n in zip(used, sides)]
  return rows


def fill_rows(plan: list[list[int]], examples: list[Example], length: int, completion_only: bool) -> dict:
  out = {key: np.zeros((len(plan), length), np.int32) for key in _KEYS}
  for r, row in enumerate(plan):
    start = 0
    for segment, index in enumerate(row, start=1):
      tokens, completion = examples[index]
      end = start + tokens.size
      counts = completion[1:] if completion_only else np.ones(tokens.size - 1, bool)
      out["inputs"][r, start:end] = tokens
      out["targets"][r, start : end - 1] = tokens[1:]
      out["inputs_position"][r, start:end] = np.arange(tokens.size)
      out["inputs_segmentation"][r, start:end] = segment
      out["targets_segmentation"][r, start : end - 1] = segment * counts
      start = end
  return out


_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")


@functools.lru_cache(maxsize=1)
def builtin_examples() -> tuple[Example, ...]:
  return tuple(example(byte_encode(p), byte_encode(c)) for p, c in arithmetic_pairs())
