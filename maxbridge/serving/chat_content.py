"""A chat's messages as the chat template and the prefill take them: content parts (OpenAI's `content: [...]`)
flattened to text, and the images of `image_url` parts for a model with a vision tower.

Text parts join with newlines, as vLLM renders content for a template that takes strings. An image part becomes
the config's image_placeholder in that text, expanded after rendering to the image's tokens, as `maxbridge
generate --image` expands it (`interop.images`); its pixels go to the prefill, image after image. Images come
inline as `data:` URLs, or as `file://` URLs under the one directory the server was given (vLLM's
--allowed-local-media-path); the server fetches nothing over the network.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any, Sequence

import jinja2
import numpy as np

from maxbridge.core.config import Config
from maxbridge.interop import images as image_io
from maxbridge.serving import codec as codec_lib
from maxbridge.serving import openai_api as api

_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)
# An image file or decoded image larger than this is refused: a request's own bytes are bounded by the body
# limit, a file's and a compressed image's pixels are not. 8192 x 8192 is past every tower's input (896 for Gemma 3).
MAX_IMAGE_BYTES = 32 * 2**20
MAX_IMAGE_PIXELS = 8192 * 8192


@dataclasses.dataclass(frozen=True)
class ImageSources:
  """Where a served model reads images from: `folder` (its preprocessor_config.json, if any) and `allowed_dir`
  (the files `file://` URLs may name; None: none)."""

  folder: str | os.PathLike | None = None
  allowed_dir: str | os.PathLike | None = None


NO_IMAGE_SOURCES = ImageSources()  # no processor file (the defaults) and no files


@dataclasses.dataclass(frozen=True)
class Vision:
  """What a served model with a tower needs to take images: its placeholder, tokens per image, processor, and the
  directory image files may be read from."""

  placeholder: str
  tokens_per_image: int
  settings: dict[str, Any]
  allowed_dir: Path | None = None

  @classmethod
  def of(cls, config: Config, sources: ImageSources) -> Vision | None:
    """None for a text-only model; a directory for image files that is none, or is given to a text-only model,
    is refused naming it."""
    allowed = None if sources.allowed_dir is None else Path(sources.allowed_dir).resolve()
    if allowed is not None and not config.use_multimodal:
      raise ValueError(
          f"--allowed-local-media-path {sources.allowed_dir}: this model takes no images (use_multimodal=false)"
      )
    if allowed is not None and not allowed.is_dir():
      raise ValueError(f"--allowed-local-media-path {sources.allowed_dir}: not a directory")
    if not config.use_multimodal:
      return None
    settings = image_io.processor_settings(sources.folder, config.image_size_for_vit)
    return cls(config.image_placeholder, config.vision_output_length, settings, allowed)


def flatten(messages: Sequence[api.Message], placeholder: str | None) -> tuple[list[dict], list[tuple[str, str]]]:
  """(the messages with each content a string, what the chat template renders; each image part's URL and the field
  naming it, in order). `placeholder` None: the model takes no images, and an image part is refused naming it."""
  flat, urls = [], []
  for i, message in enumerate(messages):
    content = message.content
    if not isinstance(content, str):
      texts = []
      for j, part in enumerate(content):
        if isinstance(part, api.TextPart):
          texts.append(part.text)
          continue
        field = f"messages.{i}.content.{j}"
        if placeholder is None:
          raise api.Refusal(400, f"{field}: an image_url part, but this model has no vision tower (text only)", field)
        texts.append(placeholder)
        urls.append((part.image_url.url, f"{field}.image_url.url"))
      content = "\n".join(texts)
    flat.append({**message.model_dump(), "content": content})
  return flat, urls


def read_image(url: str, field: str, allowed_dir: Path | None) -> bytes:
  """The bytes of a `data:image/...;base64,` URL, or of a `file://` URL's file under `allowed_dir`; anything else
  refused naming `field` and why."""
  if url.startswith("file://"):
    return _read_file(urllib.parse.unquote(urllib.parse.urlparse(url).path), field, allowed_dir)
  match = _DATA_URL.fullmatch(url)
  if match is None:
    shown = url if len(url) <= 60 else url[:57] + "..."
    raise api.Refusal(
        400,
        f"{field}: {shown!r} is neither a data:image/...;base64, URL nor a file:// one; this server fetches "
        "nothing over the network",
        field,
    )
  try:
    return base64.b64decode(match.group(1), validate=True)
  except binascii.Error as e:
    raise api.Refusal(400, f"{field}: its base64 data cannot be decoded: {e}", field) from e


def _read_file(path: str, field: str, allowed_dir: Path | None) -> bytes:
  if allowed_dir is None:
    raise api.Refusal(
        400, f"{field}: a file:// URL, but this server reads no files (start it with --allowed-local-media-path)", field
    )
  resolved = Path(path).resolve()  # a link or ".." that leaves the directory is judged by where it leads
  if not resolved.is_relative_to(allowed_dir):
    raise api.Refusal(400, f"{field}: {path} is outside the allowed directory {allowed_dir}", field)
  try:
    size = resolved.stat().st_size
    if size > MAX_IMAGE_BYTES:
      raise api.Refusal(400, f"{field}: {path} has {size} bytes, more than {MAX_IMAGE_BYTES} an image may", field)
    return resolved.read_bytes()
  except OSError as e:
    raise api.Refusal(400, f"{field}: {path} cannot be read: {e.strerror or e}", field) from e


def _image(data: bytes, field: str, settings: dict[str, Any]) -> np.ndarray:
  try:
    return image_io.preprocess(image_io.decode(data, MAX_IMAGE_PIXELS), settings)
  except image_io.ImageError as e:
    raise api.Refusal(400, f"{field}: {e}", field) from e


def chat_prompt(
    template: jinja2.Template | None,
    codec: codec_lib.Codec,
    messages: Sequence[api.Message],
    vision: Vision | None,
    *,
    add_generation_prompt: bool = True,
    read_images: bool = True,
) -> tuple[list[int], np.ndarray | None]:
  """(the rendered chat's tokens, its images preprocessed [N, H, W, C] or None). With `read_images` false
  (/tokenize) the tokens only: each image's tokens are counted, its data not decoded."""
  if template is None:
    raise api.Refusal(
        400,
        "this model has no chat template (tokenizer_config.json's chat_template in its tokenizer folder): "
        "use /v1/completions",
        "messages",
    )
  flat, urls = flatten(messages, None if vision is None else vision.placeholder)
  try:
    text = template.render(messages=flat, add_generation_prompt=add_generation_prompt, **codec.special_tokens)
  except jinja2.exceptions.TemplateError as e:
    raise api.Refusal(400, f"the chat template refused these messages: {e}", "messages") from e
  if not urls:
    return codec.encode(text), None
  found = text.count(vision.placeholder)
  if found != len(urls):  # the text itself spelled the placeholder, or the template dropped a message's content
    raise api.Refusal(
        400,
        f"the rendered chat holds {found} image placeholders ({vision.placeholder!r}) for {len(urls)} image_url "
        "parts: give the placeholder only through image parts",
        "messages",
    )
  tokens = codec.encode(image_io.expand_placeholders(text, vision.placeholder, vision.tokens_per_image))
  if not read_images:
    return tokens, None
  pixels = [_image(read_image(url, field, vision.allowed_dir), field, vision.settings) for url, field in urls]
  return tokens, np.stack(pixels)
