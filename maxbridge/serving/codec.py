"""Text <-> tokens for the server: the model's tokenizer (or bytes), its end-of-sequence ids and chat template."""

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jinja2.sandbox


@dataclasses.dataclass
class Codec:
  """Text <-> tokens for the server: the model's tokenizer (or bytes), its end-of-sequence ids and chat template."""

  encode: Callable[..., list[int]]  # (text, add_special_tokens=True) -> ids, as `pretrained.TextTokenizer.encode`
  decode: Callable[[list[int]], str]
  eos_ids: tuple[int, ...] = ()
  chat_template: str | None = None
  special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token, eos_token for the template
  settings: dict = dataclasses.field(default_factory=dict)  # tokenizer_config.json, for /tokenizer_info
  tokenizer_class: str = "unknown"
  token_strs: Callable[[list[int]], list[str]] | None = None  # /tokenize's return_token_strs

  @classmethod
  def from_folder(cls, encode, decode, folder: Path, token_strs=None) -> "Codec":
    """With the chat template and special tokens of `folder`'s tokenizer_config.json and the end-of-sequence ids
    of its generation_config.json or config.json, as Hugging Face folders hold them (each optional)."""

    def read(name: str) -> dict:
      path = folder / name
      try:
        return json.loads(path.read_text()) if path.is_file() else {}
      except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from e

    settings = read("tokenizer_config.json")
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    special = {}
    for key in ("bos_token", "eos_token"):
      value = settings.get(key)
      special[key] = value.get("content", "") if isinstance(value, dict) else (value or "")
    eos = read("generation_config.json").get("eos_token_id", read("config.json").get("eos_token_id"))
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    # The class transformers would load (the CLI reads tokenizer.json when there is one, else takes UTF-8 bytes).
    kind = settings.get("tokenizer_class") or (
        "PreTrainedTokenizerFast" if (folder / "tokenizer.json").is_file() else "ByteTokenizer"
    )
    return cls(encode, decode, eos, template, special, settings, kind, token_strs)

  def tokenizer_info(self) -> dict:
    """/tokenizer_info as vLLM answers it: the tokenizer's settings (tokenizer_config.json, less its file paths;
    added tokens as their text), its class, and the chat template the server renders."""

    def plain(value):
      if isinstance(value, dict):
        return value["content"] if isinstance(value.get("content"), str) else {k: plain(v) for k, v in value.items()}
      return [plain(v) for v in value] if isinstance(value, list) else value

    info = {k: plain(v) for k, v in self.settings.items() if k not in ("vocab_file", "merges_file")}
    for key, text in self.special_tokens.items():  # named even when unset, as vLLM does (clients test for the key)
      info.setdefault(key, text or None)
    info["tokenizer_class"] = self.tokenizer_class
    if self.chat_template:
      info["chat_template"] = self.chat_template
    return info


def chat_template(source: str | None) -> jinja2.Template | None:
  """`source` compiled, or None."""
  if not source:
    return None
  # As transformers renders chat templates: a sandbox, trimmed blocks, raise_exception for the template's checks.
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env.globals["raise_exception"] = raise_exception
  return env.from_string(source)
