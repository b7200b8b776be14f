"""Supervised fine-tuning data: prompt -> completion examples, packed whole into rows.

An example is a prompt and a completion (or a chat of `messages`, rendered by
a template into the same two kinds of span). Examples are packed whole, one
segment each, so attention never crosses examples (the segment ids) and no
example is cut from its prompt; a row that cannot fit the next example is
padded. An example longer than a row (max_target_length) is cut to it, with
a warning that counts those cut; one that would keep no completion token is
refused, naming its file and line. With `sft_train_on_completion_only`,
`targets_segmentation` is 0 on every target that is a prompt token, so the
loss (plain cross-entropy, which masks on it) counts completion tokens only.

Without a dataset_path the rows come from a built-in set generated
deterministically: `a+b=` -> `<sum>\n` for a, b in [0, ARITHMETIC_MAX].

Chat template (byte tokens, no tokenizer_path): each message is rendered as

    <|role|>\n{content}<|end|>\n

with role "system", "user" or "assistant"; the assistant's `{content}<|end|>`
is its completion, the rest is prompt. With a Hugging Face tokenizer folder
(`tokenizer_path`) with a chat template (chat_template.jinja, or
tokenizer_config.json's `chat_template`), that template renders the chat
instead, and each assistant turn is the text the template adds after the
generation prompt.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from maxbridge.interop import pretrained

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
  """A Hugging Face tokenizer folder: tokenizer.json encodes, its chat template renders.

  The template is chat_template.jinja where the folder has one, else tokenizer_config.json's
  `chat_template` (a string, or a list of named templates of which "default" is used), as
  `transformers` reads them; it renders in a sandbox with Hugging Face's `raise_exception`.
  """

  def __init__(self, folder: str, vocab_size: int | None = None):
    path = Path(folder)
    self.tokenizer = pretrained.load_tokenizer(path, vocab_size, key=f"tokenizer_path={folder!r}")
    settings = path / "tokenizer_config.json"
    self.settings = _json_object(settings) if settings.is_file() else {}
    self.template, self.source = _chat_template(path, self.settings)

  @functools.cached_property
  def compiled(self):
    # On first use: DPO only encodes, and a template it never renders is not its concern.
    return _compile_template(self.template, self.source)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def _render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    special = {k: v for k, v in self.settings.items() if k.endswith("_token") and isinstance(v, str)}
    try:
      return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
    except Exception as e:  # the template is the user's code: whatever it raises is theirs to fix
      raise ValueError(f"{where}: {self.source} fails on this row's messages: {type(e).__name__}: {e}") from e

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
      before = self._render(messages[:i], True, where)
      after = self._render(messages[: i + 1], False, where)
      if not (before.startswith(done) and after.startswith(before)):
        raise ValueError(f"{where}: {self.source} does not render turns as prefixes of each other")
      prompt, answer = self.encode(before[len(done) :]), self.encode(after[len(before) :])
      tokens += prompt + answer
      mask += [False] * len(prompt) + [True] * len(answer)
      done = after
    return np.asarray(tokens, np.int32), np.asarray(mask, bool)


def _json_object(path: Path) -> dict:
  try:
    settings = json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not JSON: {e}") from e
  if not isinstance(settings, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(settings).__name__}")
  return settings


def _chat_template(folder: Path, settings: dict) -> tuple[str | None, str]:
  """(the template, where it is written) as `transformers` picks it: the .jinja file wins over the config key."""
  file = folder / "chat_template.jinja"
  if file.is_file():
    return file.read_text(encoding="utf-8"), str(file)
  template, source = settings.get("chat_template"), f"{folder / 'tokenizer_config.json'}'s chat_template"
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if "default" not in named:
      raise ValueError(f"{source} is a list of named templates with none named 'default' (names: {sorted(named)})")
    template, source = named["default"], f"{source} 'default'"
  if template is not None and not isinstance(template, str):
    raise ValueError(f"{source} must be a Jinja template string, got {type(template).__name__}")
  return template, source


def _compile_template(template: str, source: str):
  import jinja2  # with the tokenizers package: only a folder with a chat template needs it
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):  # what Hugging Face's templates call to reject a conversation
    raise jinja2.TemplateError(message)

  environment = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
  )
  environment.globals["raise_exception"] = raise_exception
  try:
    return environment.from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"{source} is not a valid Jinja template: line {e.lineno}: {e.message}") from e


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


def jsonl_examples(path: Path, chat=None, length: int | None = None) -> list[Example]:
  """Examples from rows with string `prompt` and `completion`, or a chat `messages` list; with `length`
  (max_target_length), fitted to it (`fit_examples`) and named by their line on a refusal."""
  examples, lines = [], []
  for number, record in read_jsonl(path):
    examples.append(record_example(record, chat, f"{path}:{number}"))
    lines.append(number)
  return examples if length is None else fit_examples(examples, length, str(path), lines)


def record_example(record: dict, chat=None, where: str = "row") -> Example:
  """The example of one row (a JSON object): string `prompt` and `completion`, or a chat `messages` list,
  encoded by `chat` (an `HFChat`) or as bytes; a row with neither is refused, naming `where`."""
  encode = chat.encode if chat else byte_encode
  if "messages" in record:
    return chat.render_chat(record["messages"], where) if chat else render_chat(record["messages"], encode, where)
  if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
    return example(encode(record["prompt"]), encode(record["completion"]))
  raise ValueError(
      f'{where}: an SFT row needs string "prompt" and "completion" fields, or a "messages" list; '
      f"it has {sorted(record)}"
  )


def fit(example: Example, length: int, where: str) -> Example:
  """`example` cut to `length` tokens; refused, naming `where`, when it has no completion token to train on.

  A completion token is trained on as the target of the token before it, so
  at least one must fit in the row after a token of its own example.
  """
  tokens, completion = example
  if not completion.any():
    raise ValueError(f"{where}: the completion is empty, so the row has nothing to train on")
  if not completion[1:].any():
    raise ValueError(
        f"{where}: the prompt is empty and the completion 1 token: no token predicts it, so nothing to train on"
    )
  if tokens.size <= length:
    return example
  if not completion[1:length].any():
    prompt = int(np.argmax(completion))  # tokens before the first completion token
    raise ValueError(
        f"{where}: the prompt is {prompt} tokens, so max_target_length={length} leaves no completion token to "
        f"train on (the row is {tokens.size} tokens); shorten the prompt or set max_target_length >= {max(prompt, 1) + 1}"
    )
  return tokens[:length], completion[:length]


def fit_examples(examples: list[Example], length: int, source: str, lines: list[int] | None = None) -> list[Example]:
  """`examples` (of `source`, the file their `lines` are in) fitted to `length` tokens (`fit`); those cut are counted
  in a warning, since their completions lose their ends."""
  fitted = [fit(e, length, f"{source}:{lines[i]}" if lines else f"{source}, example {i}") for i, e in enumerate(examples)]
  warn_cut(source, sum(e[0].size > length for e in examples), len(examples), length)
  return fitted


def warn_cut(source: str, cut: int, total: int, length: int) -> None:
  if cut:
    warnings.warn(
        f"{source}: {cut} of {total} examples are longer than max_target_length={length} tokens and were cut to it: "
        "the end of their completions is not trained on",
        stacklevel=3,
    )


def pack_examples(examples: list[Example], length: int, completion_only: bool) -> dict[str, np.ndarray]:
  """Whole examples into rows of `length`, one segment each; MaxText's batch keys, int32 [rows, length].

  An example longer than a row is cut to `length` tokens (callers fit examples
  first, `fit_examples`, so that a cut is reported and a lost completion refused).
  The target of a token counts (nonzero `targets_segmentation`) when the next
  token is in the same example and, with `completion_only`, is a completion token.
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
